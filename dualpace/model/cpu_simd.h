// `vf`: 16 float32 lanes, the one vector type the CPU kernels are written against, for three
// instruction sets picked by the variant's compile flags (see KERNELS.md):
//   AVX-512F   one __m512 (masked loads and stores for tails)
//   AVX2       two __m256 (FMA and F16C come with the avx2 variant)
//   otherwise  a float[16] the compiler vectorises (-O3 -march=native, -DDP_GENERIC), for aarch64,
//              x86 without AVX2, and for testing that code on any machine
// bf16 values are uint16_t bits; loads widen them exactly, stores round to nearest even.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// The generic variant (-DDP_GENERIC) uses the plain C++ vf whatever the compiler targets.
#if !defined(DP_GENERIC) && defined(__AVX512F__)
#define DP_ISA_AVX512 1
#elif !defined(DP_GENERIC) && defined(__AVX2__)
#define DP_ISA_AVX2 1
#endif
#if !defined(DP_GENERIC) && defined(__AVX512BF16__)
#define DP_ISA_BF16DOT 1
#endif

#if defined(DP_ISA_AVX512) || defined(DP_ISA_AVX2)
#include <immintrin.h>
#endif

namespace dp {

using bf16 = uint16_t;

inline float bf2f(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

inline float to_f32(bf16 v) { return bf2f(v); }
inline float to_f32(float v) { return v; }
inline bf16 from_f32(float v, const bf16*) { return f2bf(v); }
inline float from_f32(float v, const float*) { return v; }
inline float round_like(float v, const float*) { return v; }
inline float round_like(float v, const bf16*) { return bf2f(f2bf(v)); }

// The batch-1 GEMV's software prefetch in each W row stream: how far ahead, and into which level
// (-D to try others). 8 KB, not 2 KB: on AMD EPYC Zen 5 one thread streaming the 212 MB of layer
// matrices from DRAM read 12-15 GB/s at 2 KB and 17-22 GB/s at 8 KB (avx2; avx512_bf16 13-19
// against 16-21), 12-16 KB no better: the
// lines in flight per core, not the arithmetic, bound it (in L3 the same pass reads 36-40 GB/s).
#ifndef DP_PREFETCH_BYTES
#define DP_PREFETCH_BYTES 8192
#endif
#ifndef DP_PREFETCH_HINT
#define DP_PREFETCH_HINT _MM_HINT_T0
#endif

inline void prefetch(const void* p) {
#if defined(DP_ISA_AVX512) || defined(DP_ISA_AVX2)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

#if defined(DP_ISA_AVX512)
// ------------------------------------------------------------------------------------- AVX-512

struct vf {
  __m512 v;
};
inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
inline vf vzero() { return {_mm512_setzero_ps()}; }
inline vf vset1(float a) { return {_mm512_set1_ps(a)}; }
inline vf vadd(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf vsub(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf vmul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf vmax(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a b + c
inline vf vfms(vf a, vf b, vf c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }   // a b - c
inline vf vfnma(vf a, vf b, vf c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b
inline float vsum(vf a) { return _mm512_reduce_add_ps(a.v); }
inline float vmaxr(vf a) { return _mm512_reduce_max_ps(a.v); }
// lanes n.. set to `fill`
inline vf vkeep_first(vf a, int64_t n, float fill) { return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), mask16(n), a.v)}; }

inline vf vload(const float* p, int64_t n = 16) {
  return {n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask16(n), p)};
}
inline vf vload(const bf16* p, int64_t n = 16) {
  __m256i raw = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                        : _mm256_maskz_loadu_epi16(mask16(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline __m256i to_bf16_bits(__m512 v) {  // round to nearest even (no NaNs among the values stored)
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
inline void vstore(float* p, vf a, int64_t n = 16) {
  if (n >= 16) _mm512_storeu_ps(p, a.v); else _mm512_mask_storeu_ps(p, mask16(n), a.v);
}
inline void vstore(bf16* p, vf a, int64_t n = 16) {
  __m256i b = to_bf16_bits(a.v);
  if (n >= 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); else _mm256_mask_storeu_epi16(p, mask16(n), b);
}
inline vf vround_bf16(vf a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(a.v)), 16))}; }

// e^x for x <= ~88, relative error ~2e-7 (degree-6 polynomial after range reduction).
inline vf vexp(vf a) {
  __m512 x = _mm512_min_ps(_mm512_max_ps(a.v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203094172e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return {_mm512_scalef_ps(p, n)};
}

// Sixteen vectors of 16 floats (p[16 i .. 16 i + 15]) -> one vector whose lane i is the sum of vector i.
__attribute__((always_inline)) inline vf vsum16(const float* p) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_loadu_ps(p + 32 * i), b = _mm512_loadu_ps(p + 32 * i + 16);
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
  __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
  // 128-bit lanes: [sums of v0..v3 | v4..v7 | v8..v11 | v12..v15]
  return {_mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd))};
}

#elif defined(DP_ISA_AVX2)
// ---------------------------------------------------------------------------------------- AVX2

struct vf {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vfms(vf a, vf b, vf c) { return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)}; }
inline vf vfnma(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vsum(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vmaxr(vf a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256i first_lanes8(int64_t n) {  // all-ones in lanes < n (n may be negative or > 8)
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : n > 8 ? 8 : n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vkeep_first(vf a, int64_t n, float fill) {
  if (n >= 16) return a;
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, _mm256_castsi256_ps(first_lanes8(n))),
          _mm256_blendv_ps(f, a.hi, _mm256_castsi256_ps(first_lanes8(n - 8)))};
}

inline vf vload(const float* p, int64_t n = 16) {
  if (n >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, first_lanes8(n)), _mm256_maskload_ps(p + 8, first_lanes8(n - 8))};
}
inline __m256 widen8(__m128i b) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)); }
inline vf vload(const bf16* p, int64_t n = 16) {
  if (n >= 16)
    return {widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  alignas(32) bf16 tmp[16] = {};
  std::memcpy(tmp, p, static_cast<size_t>(n) * sizeof(bf16));
  return vload(tmp);
}
inline __m256i to_bf16_bits(vf a) {  // 16 x bf16, round to nearest even (no NaNs among the values stored)
  auto round = [](__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  };
  // packus interleaves 128-bit lanes: [lo0-3 hi0-3 | lo4-7 hi4-7] -> reorder the 64-bit quarters
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(round(a.lo), round(a.hi)), 0xd8);
}
inline void vstore(float* p, vf a, int64_t n = 16) {
  if (n >= 16) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  _mm256_maskstore_ps(p, first_lanes8(n), a.lo);
  _mm256_maskstore_ps(p + 8, first_lanes8(n - 8), a.hi);
}
inline void vstore(bf16* p, vf a, int64_t n = 16) {
  const __m256i b = to_bf16_bits(a);
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
    return;
  }
  alignas(32) bf16 tmp[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), b);
  std::memcpy(p, tmp, static_cast<size_t>(n) * sizeof(bf16));
}
inline vf vround_bf16(vf a) {
  const __m256i b = to_bf16_bits(a);
  return {widen8(_mm256_castsi256_si128(b)), widen8(_mm256_extracti128_si256(b, 1))};
}

inline __m256 exp8(__m256 x) {  // as the AVX-512 vexp; 2^n built in the exponent bits
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068203094172e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf vexp(vf a) { return {exp8(a.lo), exp8(a.hi)}; }

// eight __m256 -> lane i = sum of vector i
inline __m256 sum8x8(const __m256* s) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
// Sixteen vectors of 16 floats (p[16 i .. 16 i + 15]) -> one vector whose lane i is the sum of vector i.
__attribute__((always_inline)) inline vf vsum16(const float* p) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(_mm256_loadu_ps(p + 16 * i), _mm256_loadu_ps(p + 16 * i + 8));
  return {sum8x8(s), sum8x8(s + 8)};
}

#else
// ----------------------------------------------------------------- plain C++ (compiler-vectorised)

struct vf {
  float x[16];
};
#define DP_VF_MAP(expr)                          \
  vf r;                                          \
  for (int i = 0; i < 16; ++i) r.x[i] = (expr); \
  return r
inline vf vzero() { DP_VF_MAP(0.0f); }
inline vf vset1(float a) { DP_VF_MAP(a); }
inline vf vadd(vf a, vf b) { DP_VF_MAP(a.x[i] + b.x[i]); }
inline vf vsub(vf a, vf b) { DP_VF_MAP(a.x[i] - b.x[i]); }
inline vf vmul(vf a, vf b) { DP_VF_MAP(a.x[i] * b.x[i]); }
inline vf vdiv(vf a, vf b) { DP_VF_MAP(a.x[i] / b.x[i]); }
inline vf vmax(vf a, vf b) { DP_VF_MAP(a.x[i] > b.x[i] ? a.x[i] : b.x[i]); }
inline vf vfma(vf a, vf b, vf c) { DP_VF_MAP(std::fma(a.x[i], b.x[i], c.x[i])); }
inline vf vfms(vf a, vf b, vf c) { DP_VF_MAP(std::fma(a.x[i], b.x[i], -c.x[i])); }
inline vf vfnma(vf a, vf b, vf c) { DP_VF_MAP(std::fma(-a.x[i], b.x[i], c.x[i])); }
inline vf vkeep_first(vf a, int64_t n, float fill) { DP_VF_MAP(i < n ? a.x[i] : fill); }
inline vf vload(const float* p, int64_t n = 16) { DP_VF_MAP(i < n ? p[i] : 0.0f); }
inline vf vload(const bf16* p, int64_t n = 16) { DP_VF_MAP(i < n ? bf2f(p[i]) : 0.0f); }
inline vf vround_bf16(vf a) { DP_VF_MAP(bf2f(f2bf(a.x[i]))); }
inline vf vexp(vf a) { DP_VF_MAP(std::exp(a.x[i] < 88.0f ? a.x[i] : 88.0f)); }
inline vf vsum16(const float* p) {
  vf r;
  for (int i = 0; i < 16; ++i) {
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) s += p[16 * i + j];
    r.x[i] = s;
  }
  return r;
}
#undef DP_VF_MAP
inline float vsum(vf a) {
  float s = 0.0f;
  for (float v : a.x) s += v;
  return s;
}
inline float vmaxr(vf a) {
  float m = a.x[0];
  for (float v : a.x) m = v > m ? v : m;
  return m;
}
inline void vstore(float* p, vf a, int64_t n = 16) {
  for (int i = 0; i < 16 && i < n; ++i) p[i] = a.x[i];
}
inline void vstore(bf16* p, vf a, int64_t n = 16) {
  for (int i = 0; i < 16 && i < n; ++i) p[i] = f2bf(a.x[i]);
}

#endif

inline vf round_like(vf a, const float*) { return a; }
inline vf round_like(vf a, const bf16*) { return vround_bf16(a); }

}  // namespace dp
