// CPU kernels for decode on x86-64 with AVX-512 (+ AVX512_BF16 for bf16 dot products).
//
// Built on first use by dualpace/model/cpu_kernels.py (g++ -O3 -march=native -fopenmp) and
// called through ctypes. Threads come from the OpenMP runtime torch itself loaded, so these
// kernels and torch's share one pool and one thread count (torch.set_num_threads).
//
// Element types: "T" is float (fp32) or uint16_t holding bfloat16 bits. All arithmetic is in
// float32; bf16 results are rounded to nearest even.
//
//   linear_bf16      y = x W^T (+ bias) (+ residual), W bf16 [N, K], small M (decode GEMV):
//                    streams W once per call and reuses each loaded W vector for up to 4 rows of x.
//   rms_norm_*       RMSNorm (rounding like the reference: normalize, round, multiply by weight).
//   rotary_*         in-place rotate-half RoPE over the q and k heads of a fused qkv row.
//   silu_mul_*       silu(gate) * up over a fused [gate | up] row.
//   kv_write         scatter a step's k and v rows into their cache slots.
//   decode_attn_*    one query token per sequence over paged KV read in place: per (sequence,
//                    context split) task, whole blocks (all kv heads) streamed once with software
//                    prefetch; per kv head, scores for all query heads of the group, an online
//                    softmax, and p @ V; splits are merged with their max and sum.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

// ---- vector load/store of 16 lanes as float32, with a count for tails ----

inline __mmask16 mask16(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1); }

inline __m512 load16(const float* p, int64_t n = 16) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask16(n), p);
}
inline __m512 load16(const bf16* p, int64_t n = 16) {
  __m256i raw = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                        : _mm256_maskz_loadu_epi16(mask16(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m256i to_bf16_bits(__m512 v) {
  // round to nearest even (NaN handling is not needed for the values stored here)
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

inline void store16(float* p, __m512 v, int64_t n = 16) {
  if (n >= 16) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, mask16(n), v);
}
inline void store16(bf16* p, __m512 v, int64_t n = 16) {
  __m256i b = to_bf16_bits(v);
  if (n >= 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); else _mm256_mask_storeu_epi16(p, mask16(n), b);
}

inline __m512 round_like(__m512 v, const float*) { return v; }
inline __m512 round_like(__m512 v, const bf16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

// e^x for x <= ~88, relative error ~2e-7 (degree-6 polynomial after range reduction).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
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
  return _mm512_scalef_ps(p, n);
}

// Sixteen vectors of 16 floats (p[16 i .. 16 i + 15]) -> one vector whose lane i is the sum of vector i.
__attribute__((always_inline)) inline __m512 reduce16(const float* p) {
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
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd));
}

// ---------------------------------------------------------------------------------------------
// linear: bf16 weights, small M
// ---------------------------------------------------------------------------------------------

template <typename T>
struct Epilogue {
  const T* bias;
  const T* residual;  // may be the output itself (in-place residual add)
  int64_t ld_residual;
  void* out;
  int64_t ld_out;
  int out_fp32;

  inline void store(int64_t m, int64_t n, float v) const {
    if (bias) v += to_f32(bias[n]);
    if (residual) v += to_f32(residual[m * ld_residual + n]);
    if (out_fp32) static_cast<float*>(out)[m * ld_out + n] = v;
    else static_cast<T*>(out)[m * ld_out + n] = from_f32(v, static_cast<const T*>(nullptr));
  }
};

constexpr int64_t PARALLEL_MIN_MACS = 1 << 18;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Rows [n0, n0 + NR) of W (rows past N are clamped to N - 1 and not stored) against MR rows of x.
template <int MR, int NR>
inline void linear_tile(const bf16* x, int64_t ldx, int64_t m0, int64_t K, const bf16* w, int64_t n0, int64_t N,
                        const Epilogue<bf16>& ep) {
  const bf16* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * K;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r)  // software prefetch 2 KB ahead in each row stream
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + 2048, _MM_HINT_T0);
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_si512(rows[r] + k);
    for (int m = 0; m < MR; ++m) {
      __m512i xv = _mm512_loadu_si512(x + (m0 + m) * ldx + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], as_bh(xv), as_bh(wv[r]));
    }
  }
  if (k < K) {
    __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, rows[r] + k);
    for (int m = 0; m < MR; ++m) {
      __m512i xv = _mm512_maskz_loadu_epi16(mask, x + (m0 + m) * ldx + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], as_bh(xv), as_bh(wv[r]));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      if (n0 + r < N) ep.store(m0 + m, n0 + r, _mm512_reduce_add_ps(acc[m][r]));
}


// The same for float32 weights and x (FMA, 16 elements per step).
template <int MR, int NR>
inline void linear_tile(const float* x, int64_t ldx, int64_t m0, int64_t K, const float* w, int64_t n0, int64_t N,
                        const Epilogue<float>& ep) {
  const float* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * K;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = mask16(K - k);
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + 2048, _MM_HINT_T0);
      wv[r] = _mm512_maskz_loadu_ps(mask, rows[r] + k);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + m) * ldx + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      if (n0 + r < N) ep.store(m0 + m, n0 + r, _mm512_reduce_add_ps(acc[m][r]));
}

// M = 1: one row of x against one row of W (bf16) with two accumulators, so that the dot
// products of a row (18 for K = 576) are two chains instead of one (latency 6 cycles each);
// measured +4% on the batch-1 step, one thread.
inline void linear_row1(const bf16* x, int64_t K, const bf16* w, int64_t n, const Epilogue<bf16>& ep) {
  const bf16* row = w + n * K;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + 2048, _MM_HINT_T0);  // 2 KB ahead, as linear_tile
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + 2048 + 64, _MM_HINT_T0);
    a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_loadu_si512(x + k)), as_bh(_mm512_loadu_si512(row + k)));
    a1 = _mm512_dpbf16_ps(a1, as_bh(_mm512_loadu_si512(x + k + 32)), as_bh(_mm512_loadu_si512(row + k + 32)));
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (K - k)) - 1);
    a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_maskz_loadu_epi16(mask, x + k)), as_bh(_mm512_maskz_loadu_epi16(mask, row + k)));
  }
  ep.store(0, n, _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)));
}
inline void linear_row1(const float* x, int64_t K, const float* w, int64_t n, const Epilogue<float>& ep) {
  linear_tile<1, 1>(x, 0, 0, K, w, n, n + 1, ep);
}
}  // namespace

extern "C" {

int dp_has_avx512_bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") ? 1 : 0;
}

}  // extern "C"

namespace {

// out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ residual[m, n]); x, w, bias, residual bf16;
// out bf16 or fp32 (out_fp32). x rows are ldx apart; out rows ld_out apart.
template <typename T>
void linear_impl(const T* x, int64_t M, int64_t ldx, int64_t K, const T* w, int64_t N, const T* bias,
                 const T* residual, int64_t ld_residual, void* out, int64_t ld_out, int out_fp32) {
  const Epilogue<T> ep{bias, residual, ld_residual, out, ld_out, out_fp32};
  // Up to SMALL_M rows of x: one W row at a time, so each thread reads one sequential stream
  // (which the prefetchers follow best: ~95% of the copy bandwidth at M = 1 on Zen 4, against
  // ~80% with four interleaved row streams). More rows: 4-row tiles reuse each W vector 4x4.
  constexpr int64_t SMALL_M = 8;
  constexpr int NR = 4;
  const int64_t num_tiles = (N + NR - 1) / NR;
  const int threads = omp_get_max_threads();
  // Chunks handed out dynamically, so that a thread slowed by another tenant hands work to the
  // other. Small M streams W: about 2 chunks per thread, because every chunk restarts a weight
  // stream (the first 2 KB of it not prefetched, the hardware prefetchers retraining); with 8
  // per thread the batch-1 step streamed ~10-20% slower (docs/perf.md). Larger M is
  // compute-bound: about 8 per thread, at most 64 tiles each.
  int64_t tiles_per_chunk;
  if (M <= SMALL_M) {
    tiles_per_chunk = std::max<int64_t>(1, num_tiles / (2 * threads));
  } else {
    tiles_per_chunk = std::max<int64_t>(1, num_tiles / (8 * threads));
    tiles_per_chunk = std::min<int64_t>(tiles_per_chunk, 64);
  }
  const int64_t num_chunks = (num_tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  // Small products stay on the calling thread: a parallel region costs a few microseconds, and
  // when several threads of one process run kernels at once (a server beside its client) their
  // OpenMP teams would compete for the same cores.
#pragma omp parallel for schedule(dynamic, 1) if (M * N * K >= PARALLEL_MIN_MACS)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t t_end = std::min(num_tiles, (c + 1) * tiles_per_chunk);
    if (M <= SMALL_M) {
      const int64_t n_end = std::min(N, t_end * NR);
      for (int64_t n = c * tiles_per_chunk * NR; n < n_end; ++n) {
        switch (M) {
          case 1: linear_row1(x, K, w, n, ep); break;
          case 2: linear_tile<2, 1>(x, ldx, 0, K, w, n, N, ep); break;
          case 3: linear_tile<3, 1>(x, ldx, 0, K, w, n, N, ep); break;
          case 4: linear_tile<4, 1>(x, ldx, 0, K, w, n, N, ep); break;
          case 5: linear_tile<5, 1>(x, ldx, 0, K, w, n, N, ep); break;
          case 6: linear_tile<6, 1>(x, ldx, 0, K, w, n, N, ep); break;
          case 7: linear_tile<7, 1>(x, ldx, 0, K, w, n, N, ep); break;
          case 8: linear_tile<8, 1>(x, ldx, 0, K, w, n, N, ep); break;
          default: break;
        }
      }
      continue;
    }
    for (int64_t t = c * tiles_per_chunk; t < t_end; ++t) {
      const int64_t n0 = t * NR;
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) linear_tile<4, NR>(x, ldx, m0, K, w, n0, N, ep);
      switch (M - m0) {
        case 3: linear_tile<3, NR>(x, ldx, m0, K, w, n0, N, ep); break;
        case 2: linear_tile<2, NR>(x, ldx, m0, K, w, n0, N, ep); break;
        case 1: linear_tile<1, NR>(x, ldx, m0, K, w, n0, N, ep); break;
        default: break;
      }
    }
  }
}

}  // namespace

extern "C" {

// out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ residual[m, n], which may alias out); out in
// the input type or fp32 (out_fp32). x rows are ldx apart; out rows ld_out apart. For M <= 8.
void dp_linear_bf16(const bf16* x, int64_t M, int64_t ldx, int64_t K, const bf16* w, int64_t N, const bf16* bias,
                    const bf16* residual, int64_t ld_residual, void* out, int64_t ld_out, int out_fp32) {
  linear_impl(x, M, ldx, K, w, N, bias, residual, ld_residual, out, ld_out, out_fp32);
}
void dp_linear_f32(const float* x, int64_t M, int64_t ldx, int64_t K, const float* w, int64_t N, const float* bias,
                   const float* residual, int64_t ld_residual, void* out, int64_t ld_out, int out_fp32) {
  linear_impl(x, M, ldx, K, w, N, bias, residual, ld_residual, out, ld_out, out_fp32);
}

}  // extern "C"

namespace {

// ---------------------------------------------------------------------------------------------
// elementwise: RMSNorm, RoPE, SiLU * up
// ---------------------------------------------------------------------------------------------

template <typename T>
void rms_norm(const T* x, int64_t M, int64_t H, int64_t ldx, const T* weight, float eps, T* out) {
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * ldx;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
      __m512 v = load16(row + i, H - i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(H) + eps);
    const __m512 vs = _mm512_set1_ps(scale);
    T* dst = out + m * H;
    for (int64_t i = 0; i < H; i += 16) {
      __m512 v = round_like(_mm512_mul_ps(load16(row + i, H - i), vs), row);
      store16(dst + i, _mm512_mul_ps(v, load16(weight + i, H - i)), H - i);
    }
  }
}

// qkv rows [M, ld]; the first num_rot_heads heads of head_dim D are rotated in place with
// cos/sin [M, D/2] (float32).
template <typename T>
void rotary(T* qkv, int64_t M, int64_t ld, int64_t num_rot_heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cos + m * half;
    const float* s = sin + m * half;
    for (int64_t h = 0; h < num_rot_heads; ++h) {
      T* x = qkv + m * ld + h * D;
      for (int64_t i = 0; i < half; i += 16) {
        const int64_t n = half - i;
        __m512 x1 = load16(x + i, n), x2 = load16(x + half + i, n);
        __m512 vc = load16(c + i, n), vs = load16(s + i, n);
        store16(x + i, _mm512_fmsub_ps(x1, vc, _mm512_mul_ps(x2, vs)), n);
        store16(x + half + i, _mm512_fmadd_ps(x2, vc, _mm512_mul_ps(x1, vs)), n);
      }
    }
  }
}

// out[m, i] = silu(gu[m, i]) * gu[m, I + i]
template <typename T>
void silu_mul(const T* gu, int64_t M, int64_t I, T* out) {
#pragma omp parallel for schedule(static) if (M * I >= 32768)
  for (int64_t m = 0; m < M; ++m) {
    const T* g = gu + m * 2 * I;
    const T* u = g + I;
    T* dst = out + m * I;
    for (int64_t i = 0; i < I; i += 16) {
      const int64_t n = I - i;
      __m512 vg = load16(g + i, n);
      __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), vg));
      __m512 silu = round_like(_mm512_div_ps(vg, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), g);
      store16(dst + i, _mm512_mul_ps(silu, load16(u + i, n)), n);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// decode attention over paged KV
// ---------------------------------------------------------------------------------------------

struct AttnShape {
  int64_t block_size, num_kv_heads, group, head_dim;
};

// partial dot products (16 lanes, to be summed) of one key row with one query head
template <int ND>
inline __m512 partial_dot(const bf16* q, const bf16* k) {  // ND = D / 32
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < ND; ++j)
    acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_loadu_si512(q + 32 * j)), as_bh(_mm512_loadu_si512(k + 32 * j)));
  return acc;
}
template <int ND>
inline __m512 partial_dot(const float* q, const float* k) {  // ND = D / 16
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int j = 1; j < ND; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * j), _mm512_loadu_ps(k + 16 * j), acc);
  return acc;
}

// p @ V over one chunk of n <= 16 tokens (rows `stride` elements apart), query heads
// [g0, g0 + NG), accumulated into acc (float32 [group, D], in the kernel's lane order).
// bf16: token pairs are interleaved so one dpbf16 multiplies two tokens' values by their two
// bf16 probabilities; the accumulator lanes are then permuted within 128-bit lanes (undone
// by unpermute_bf16 at the end).
template <int ND, int NG>
__attribute__((always_inline)) inline void pv_chunk(const bf16* v, int64_t stride, int64_t n, const bf16* probs /* [group, ld] */, int64_t ld,
                     int64_t g0, float* acc_mem) {
  __m512 acc[NG][2 * ND];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 2 * ND; ++j) acc[g][j] = _mm512_loadu_ps(acc_mem + ((g0 + g) * 2 * ND + j) * 16);
  for (int64_t i = 0; i < n; i += 2) {
    const bf16* a = v + i * stride;
    __m512i il[2 * ND];
    for (int j = 0; j < ND; ++j) {
      __m512i va = _mm512_loadu_si512(a + 32 * j);
      __m512i vb = i + 1 < n ? _mm512_loadu_si512(a + stride + 32 * j) : _mm512_setzero_si512();
      il[2 * j] = _mm512_unpacklo_epi16(va, vb);
      il[2 * j + 1] = _mm512_unpackhi_epi16(va, vb);
    }
    for (int g = 0; g < NG; ++g) {
      uint32_t pair;
      std::memcpy(&pair, probs + (g0 + g) * ld + i, 4);
      __m512i pp = _mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 2 * ND; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], as_bh(pp), as_bh(il[j]));
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 2 * ND; ++j) _mm512_storeu_ps(acc_mem + ((g0 + g) * 2 * ND + j) * 16, acc[g][j]);
}

template <int ND, int NG>
__attribute__((always_inline)) inline void pv_chunk(const float* v, int64_t stride, int64_t n, const float* probs, int64_t ld, int64_t g0,
                     float* acc_mem) {
  __m512 acc[NG][ND];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < ND; ++j) acc[g][j] = _mm512_loadu_ps(acc_mem + ((g0 + g) * ND + j) * 16);
  for (int64_t i = 0; i < n; ++i) {
    __m512 vv[ND];
    for (int j = 0; j < ND; ++j) vv[j] = _mm512_loadu_ps(v + i * stride + 16 * j);
    for (int g = 0; g < NG; ++g) {
      __m512 p = _mm512_set1_ps(probs[(g0 + g) * ld + i]);
      for (int j = 0; j < ND; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < ND; ++j) _mm512_storeu_ps(acc_mem + ((g0 + g) * ND + j) * 16, acc[g][j]);
}

// accumulator lane -> element of the head (bf16 layout from pv_chunk; fp32 is the identity)
inline void unpermute(const float* acc, int64_t D, float* out, const bf16*) {
  for (int64_t j = 0; j < D / 32; ++j)
    for (int half = 0; half < 2; ++half)
      for (int lane = 0; lane < 4; ++lane)
        for (int e = 0; e < 4; ++e) out[32 * j + lane * 8 + half * 4 + e] = acc[(2 * j + half) * 16 + lane * 4 + e];
}
inline void unpermute(const float* acc, int64_t D, float* out, const float*) { std::memcpy(out, acc, D * 4); }

// Stores probabilities (bf16: rounded to nearest even by vcvtneps2bf16) and returns the stored values.
inline __m512 store_probs(bf16* dst, __m512 p) {
  const __m256bh converted = _mm512_cvtneps_pbh(p);
  __m256i bits;
  std::memcpy(&bits, &converted, sizeof(bits));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 store_probs(float* dst, __m512 p) {
  _mm512_storeu_ps(dst, p);
  return p;
}

// Scores of query heads [g0, g0 + NG) against one chunk of n <= 16 key rows (`stride` apart):
// scores[g * ld + i] = scale * q_g . k_i, lanes past n set to -inf. Each key row is loaded once
// for the NG heads; one reduce16 per head turns the 16 partial vectors into 16 scores.
template <int ND, int NG, typename T>
__attribute__((always_inline)) inline void chunk_scores(const T* q, int64_t D, const T* k, int64_t stride, int64_t n,
                                                        int64_t g0, float* parts, __m512 vscale, float* scores,
                                                        int64_t ld) {
  for (int64_t i = 0; i < n; ++i, k += stride)
    for (int g = 0; g < NG; ++g) _mm512_store_ps(parts + (g * 16 + i) * 16, partial_dot<ND>(q + (g0 + g) * D, k));
  for (int g = 0; g < NG; ++g) {
    for (int64_t i = n; i < 16; ++i) _mm512_store_ps(parts + (g * 16 + i) * 16, _mm512_setzero_ps());
    const __m512 sc = _mm512_mul_ps(reduce16(parts + g * 256), vscale);
    _mm512_store_ps(scores + (g0 + g) * ld, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask16(n), sc));
  }
}

// bf16 scores with tokens in lanes. A chunk's key rows are taken 4 tokens at a time and
// transposed in two shuffle stages, so that vector o of column block c holds, in 128-bit lane c'
// and dword t, token t's dimension pair 4 c' + o; one dpbf16 against the query permuted the same
// way (q_perm, built once per task) accumulates partial scores with the 4 tokens in the lanes
// of each 128-bit lane, and one 4x4 shuffle-reduce of the four 4-token groups gives 16 scores.
// Against a horizontal reduction per (token, query head), the shuffles here are per key row and
// shared by the whole query-head group.
template <int ND>
__attribute__((always_inline)) inline void chunk_scores_lanes(const bf16* q_perm /* [group][ND][4][32] */,
                                                              int64_t G, const bf16* k, int64_t stride, int64_t n,
                                                              __m512 vscale, float* scores, int64_t ld,
                                                              float* parts /* [group][4][16] */) {
  for (int tg = 0; tg < 4; ++tg) {
    if (4 * tg >= n) {
      for (int64_t g = 0; g < G; ++g) _mm512_store_ps(parts + (g * 4 + tg) * 16, _mm512_setzero_ps());
      continue;
    }
    __m512i u[ND][4];
    for (int c = 0; c < ND; ++c) {
      __m512i r[4];
      for (int t = 0; t < 4; ++t)
        r[t] = 4 * tg + t < n ? _mm512_loadu_si512(k + (4 * tg + t) * stride + 32 * c) : _mm512_setzero_si512();
      const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
      const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
      u[c][0] = _mm512_unpacklo_epi64(t0, t2);
      u[c][1] = _mm512_unpackhi_epi64(t0, t2);
      u[c][2] = _mm512_unpacklo_epi64(t1, t3);
      u[c][3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int64_t g = 0; g < G; ++g) {
      const bf16* qg = q_perm + g * ND * 4 * 32;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      for (int c = 0; c < ND; ++c) {
        a0 = _mm512_dpbf16_ps(a0, as_bh(u[c][0]), as_bh(_mm512_load_si512(qg + (4 * c + 0) * 32)));
        a1 = _mm512_dpbf16_ps(a1, as_bh(u[c][1]), as_bh(_mm512_load_si512(qg + (4 * c + 1) * 32)));
        a0 = _mm512_dpbf16_ps(a0, as_bh(u[c][2]), as_bh(_mm512_load_si512(qg + (4 * c + 2) * 32)));
        a1 = _mm512_dpbf16_ps(a1, as_bh(u[c][3]), as_bh(_mm512_load_si512(qg + (4 * c + 3) * 32)));
      }
      _mm512_store_ps(parts + (g * 4 + tg) * 16, _mm512_add_ps(a0, a1));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* x = parts + g * 64;
    const __m512 x0 = _mm512_load_ps(x), x1 = _mm512_load_ps(x + 16), x2 = _mm512_load_ps(x + 32),
                 x3 = _mm512_load_ps(x + 48);
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xdd));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x2, x3, 0x88), _mm512_shuffle_f32x4(x2, x3, 0xdd));
    const __m512 sc = _mm512_mul_ps(
        _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd)), vscale);
    _mm512_store_ps(scores + g * ld, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask16(n), sc));
  }
}

// q [group, D] bf16 -> q_perm [group][ND][4][32] for chunk_scores_lanes: vector (c, o) holds in
// dword 4 c' + t the query's dimension pair 16 c + 4 c' + o.
template <int ND>
inline void permute_query(const bf16* q, int64_t G, bf16* q_perm) {
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) {
      const __m512i qc = _mm512_loadu_si512(q + g * ND * 32 + 32 * c);
      for (int o = 0; o < 4; ++o) {
        const __m512i idx = _mm512_set_epi32(12 + o, 12 + o, 12 + o, 12 + o, 8 + o, 8 + o, 8 + o, 8 + o, 4 + o, 4 + o,
                                             4 + o, 4 + o, o, o, o, o);
        _mm512_store_si512(q_perm + ((g * ND + c) * 4 + o) * 32, _mm512_permutexvar_epi32(idx, qc));
      }
    }
}

// Software prefetch of a task's later blocks, paced: a few cache lines of K and V per call, one
// call after each 16-token chunk of scores and of p @ V, so that the lines of the next window
// arrive while this one is computed. (Prefetching a whole block at once, 192 lines for SmolLM2,
// filled the load queue and the miss buffers in a burst and stalled the computation behind it:
// the kernel then read DRAM at ~11 GB/s per thread where a plain read of the same blocks
// reaches 20-28.)
struct KVPrefetcher {
  const char *k_cache, *v_cache;
  const int64_t* table;
  int64_t block_bytes, row_bytes, block_size, len, blk, blk_end, off, bytes;
  const char *k, *v;

  void seek(int64_t b) {
    blk = b;
    off = 0;
    if (blk >= blk_end) {
      k = v = nullptr;
      return;
    }
    k = k_cache + table[blk] * block_bytes;
    v = v_cache + table[blk] * block_bytes;
    bytes = std::min(block_size, len - blk * block_size) * row_bytes;
  }
  inline void step(int64_t lines) {
    for (; lines > 0 && k; --lines) {
      _mm_prefetch(k + off, _MM_HINT_T0);
      _mm_prefetch(v + off, _MM_HINT_T0);
      off += 64;
      if (off >= bytes) seek(blk + 1);
    }
  }
};

// One window (up to WINDOW chunks of <= 16 tokens) of one kv head for all query heads of its
// group: scores (bf16: from q_perm, see chunk_scores_lanes; fp32: from q), one online-softmax
// update per query head, p @ V. k/v chunk pointers point at the head's row in each chunk's first
// token. The state is updated: m [group], l [group][16] (per-lane partial sums of exp, reduced
// once at the end of the task) and acc [group][LANES][16].
template <typename T, int ND, int MAX_NG, int WINDOW>
__attribute__((always_inline)) inline void attn_window(const T* q /* [group, D] */, const bf16* q_perm, int64_t G,
                                                       int64_t D,
                                                       int64_t stride, __m512 vscale, const T* const* chunk_k,
                                                       const T* const* chunk_v, const int64_t* chunk_n,
                                                       int64_t n_chunks, float* m, float* l /* [group][16] */,
                                                       float* acc, KVPrefetcher& pf, int64_t pf_lines) {
  constexpr int64_t LANES = sizeof(T) == 2 ? 2 * ND : ND;  // accumulator vectors per query head
  constexpr int64_t ld = WINDOW * 16;
  alignas(64) float scores[16 * WINDOW * 16];  // [group][window tokens]
  alignas(64) T probs[16 * WINDOW * 16];       // [group][window tokens]
  if constexpr (sizeof(T) == 2) {
    alignas(64) float parts[16 * 4 * 16];  // [group][4 token groups][16 lanes]
    for (int64_t w = 0; w < n_chunks; ++w) {
      chunk_scores_lanes<ND>(q_perm, G, chunk_k[w], stride, chunk_n[w], vscale, scores + 16 * w, ld, parts);
      pf.step(pf_lines);
    }
  } else {
    alignas(64) float parts[4 * 16 * 16];  // [4 heads][16 tokens][16 lanes]
    for (int64_t w = 0; w < n_chunks; ++w) {
      const T* k = chunk_k[w];
      const int64_t n = chunk_n[w];
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: chunk_scores<ND, 4>(q, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
          case 3: chunk_scores<ND, 3>(q, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
          case 2: chunk_scores<ND, 2>(q, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
          default: chunk_scores<ND, 1>(q, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
        }
      }
      pf.step(pf_lines);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t w = 0; w < n_chunks; ++w) vmax = _mm512_max_ps(vmax, _mm512_load_ps(scores + g * ld + 16 * w));
    const float m_new = std::max(m[g], _mm512_reduce_max_ps(vmax));
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t w = 0; w < n_chunks; ++w) {
      const __m512 p = _mm512_maskz_mov_ps(mask16(chunk_n[w]),
                                           exp512(_mm512_sub_ps(_mm512_load_ps(scores + g * ld + 16 * w), vm)));
      // bf16 probabilities, as in the reference; the sum counts the rounded values
      vsum = _mm512_add_ps(vsum, store_probs(probs + g * ld + 16 * w, p));
    }
    __m512 lv = _mm512_load_ps(l + 16 * g);  // per-lane partial sums of exp
    if (m_new != m[g]) {
      const float factor = std::exp(m[g] - m_new);  // 0 on the first window (m = -inf)
      const __m512 vf = _mm512_set1_ps(factor);
      lv = _mm512_mul_ps(lv, vf);
      for (int64_t j = 0; j < LANES; ++j) {
        float* a = acc + (g * LANES + j) * 16;
        _mm512_store_ps(a, _mm512_mul_ps(_mm512_load_ps(a), vf));
      }
      m[g] = m_new;
    }
    _mm512_store_ps(l + 16 * g, _mm512_add_ps(lv, vsum));
  }
  for (int64_t w = 0; w < n_chunks; ++w) {
    const T* v = chunk_v[w];
    const T* pw = probs + 16 * w;
    const int64_t n = chunk_n[w];
    for (int64_t g0 = 0; g0 < G; g0 += MAX_NG) {
      switch (std::min<int64_t>(MAX_NG, G - g0)) {
        case 4: pv_chunk<ND, 4>(v, stride, n, pw, ld, g0, acc); break;
        case 3: pv_chunk<ND, 3>(v, stride, n, pw, ld, g0, acc); break;
        case 2: pv_chunk<ND, 2>(v, stride, n, pw, ld, g0, acc); break;
        default: pv_chunk<ND, 1>(v, stride, n, pw, ld, g0, acc); break;
      }
    }
    pf.step(pf_lines);
  }
}

// One task: blocks [blk0, blk1) of one sequence (context `len` tokens), all kv heads and all
// query heads of their groups, reading the blocks in place. The blocks are walked once, and each
// window of up to WINDOW chunks of <= 16 tokens is computed for every kv head in turn, so a task
// reads whole blocks (all heads' rows are adjacent in the cache) as one sequential stream
// instead of one head's rows spread over the block. Writes per query head the unnormalized
// output [D] (element order), the running max and the sum of exp.
template <typename T, int ND, int MAX_NG>
void attn_task(const T* q /* [kv heads, group, D] */, float scale, const T* k_cache, const T* v_cache,
               const int64_t* table, int64_t blk0, int64_t blk1, int64_t len, const AttnShape& s, float* m_out,
               float* l_out, float* out) {
  const int64_t h0 = 0, h1 = s.num_kv_heads;
  constexpr int WINDOW = 4;  // chunks
  const int64_t G = s.group, D = s.head_dim, stride = s.num_kv_heads * D;
  constexpr int64_t LANES = sizeof(T) == 2 ? 2 * ND : ND;
  const int64_t num_q = (h1 - h0) * G;  // query heads of this task
  alignas(64) float acc_local[32 * 8 * 16];
  std::vector<float> acc_heap;
  float* acc = acc_local;
  if (num_q * LANES * 16 > 32 * 8 * 16) {
    acc_heap.resize(num_q * LANES * 16 + 16);
    acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc_heap.data()) + 63) & ~uintptr_t(63));
  }
  std::fill(acc, acc + num_q * LANES * 16, 0.0f);
  float m_local[64];
  alignas(64) float l_local[64 * 16];  // [query head][16 lanes] partial sums
  std::vector<float> ml_heap;
  float *m = m_local, *l = l_local;
  if (num_q > 64) {
    ml_heap.resize(17 * num_q + 16);
    l = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ml_heap.data()) + 63) & ~uintptr_t(63));
    m = l + 16 * num_q;
  }
  for (int64_t g = 0; g < num_q; ++g) m[g] = -INFINITY;
  std::fill(l, l + 16 * num_q, 0.0f);
  const __m512 vscale = _mm512_set1_ps(scale);
  std::vector<bf16> q_perm_heap;
  alignas(64) bf16 q_perm_local[sizeof(T) == 2 ? 32 * 4 * 4 * 32 : 1];
  bf16* q_perm = q_perm_local;
  if constexpr (sizeof(T) == 2) {
    const int64_t need = num_q * ND * 4 * 32;
    if (need > 32 * 4 * 4 * 32) {
      q_perm_heap.resize(need + 32);
      q_perm = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(q_perm_heap.data()) + 63) & ~uintptr_t(63));
    }
    permute_query<ND>(reinterpret_cast<const bf16*>(q) + h0 * G * D, num_q, q_perm);
  }
  const T* chunk_k[WINDOW];
  const T* chunk_v[WINDOW];
  int64_t chunk_n[WINDOW];
  int num_chunks = 0;

  // The prefetcher starts one window after the first and is kept between one and three windows
  // ahead of the window being computed. Per call (2 per chunk and kv head) it issues as many
  // lines of K and of V as the computation consumes: chunk tokens * D * sizeof(T) / 128, i.e.
  // one window's worth per window. (Measured, 1 thread: 0.75x that pace 16.5 GB/s, 1x 21.5,
  // 1.25x 19.7, 2x 15.1; a faster pace bursts again, a slower one falls behind.)
  const int64_t window_blocks = std::max<int64_t>(1, WINDOW * 16 / s.block_size);
  KVPrefetcher pf{reinterpret_cast<const char*>(k_cache), reinterpret_cast<const char*>(v_cache), table,
                  s.block_size * stride * static_cast<int64_t>(sizeof(T)), stride * static_cast<int64_t>(sizeof(T)),
                  s.block_size, len, 0, blk1, 0, 0, nullptr, nullptr};
  pf.seek(blk0 + window_blocks);
  const int64_t pf_lines =
      std::max<int64_t>(1, std::min<int64_t>(16, s.block_size) * D * static_cast<int64_t>(sizeof(T)) / 128);
  int64_t pf_lines_now = pf_lines;

  auto run_window = [&]() {
    for (int64_t h = h0; h < h1; ++h) {
      const T* hk[WINDOW];
      const T* hv[WINDOW];
      for (int w = 0; w < num_chunks; ++w) {
        hk[w] = chunk_k[w] + h * D;
        hv[w] = chunk_v[w] + h * D;
      }
      const int64_t i = (h - h0) * G;
      const bf16* qp = sizeof(T) == 2 ? q_perm + i * ND * 4 * 32 : nullptr;
      attn_window<T, ND, MAX_NG, WINDOW>(q + h * G * D, qp, G, D, stride, vscale, hk, hv, chunk_n, num_chunks, m + i,
                                         l + 16 * i, acc + i * LANES * 16, pf, pf_lines_now);
    }
    num_chunks = 0;
  };

  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int64_t base = table[blk] * s.block_size * stride;
    const int64_t n_block = std::min(s.block_size, len - blk * s.block_size);
    for (int64_t c = 0; c < n_block; c += 16) {
      chunk_k[num_chunks] = k_cache + base + c * stride;
      chunk_v[num_chunks] = v_cache + base + c * stride;
      chunk_n[num_chunks] = std::min<int64_t>(16, n_block - c);
      if (++num_chunks == WINDOW) {
        if (pf.blk <= blk) pf.seek(blk + 1);  // fell behind
        pf_lines_now = pf.blk > blk + 3 * window_blocks ? 0 : pf_lines;  // far enough ahead
        run_window();
      }
    }
  }
  if (num_chunks) run_window();
  for (int64_t g = 0; g < num_q; ++g) {
    m_out[g] = m[g];
    l_out[g] = _mm512_reduce_add_ps(_mm512_load_ps(l + 16 * g));
    unpermute(acc + g * LANES * 16, D, out + g * D, static_cast<const T*>(nullptr));
  }
}

// Returns 0, or -2 when a context length or block id is out of range (nothing computed).
template <typename T, int ND, int MAX_NG>
int decode_attention(const T* q, int64_t ldq, const T* k_cache, const T* v_cache, int64_t num_blocks,
                     const int64_t* tables, int64_t ld_tables, const int64_t* context_lens, int64_t B,
                     const AttnShape& s, float scale, T* out, int64_t ld_out) {
  const int64_t KVH = s.num_kv_heads, G = s.group, D = s.head_dim, NQ = KVH * G;
  if (G > 16) return -1;
  const int threads = omp_get_max_threads();
  int64_t max_blocks = 0, total_blocks = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = (context_lens[b] + s.block_size - 1) / s.block_size;
    if (context_lens[b] < 1 || nb > ld_tables) return -2;
    for (int64_t i = 0; i < nb; ++i)
      if (tables[b * ld_tables + i] < 0 || tables[b * ld_tables + i] >= num_blocks) return -2;
    max_blocks = std::max(max_blocks, nb);
    total_blocks += nb;
  }
  // Tasks are (sequence, context split), each over all kv heads: a task streams whole blocks.
  // Long contexts are split (at block boundaries) so that there are about TASKS_PER_THREAD
  // tasks per thread (a thread slowed by another tenant hands work to the other); the splits
  // are merged with their max and sum below. A split covers at least MIN_SPLIT_TOKENS.
  constexpr int64_t TASKS_PER_THREAD = 8;
  constexpr int64_t MIN_SPLIT_TOKENS = 256;
  int64_t splits = 1;
  if (B < TASKS_PER_THREAD * threads)
    splits = std::max<int64_t>(1, std::min<int64_t>({(TASKS_PER_THREAD * threads + B - 1) / B,
                                                     max_blocks * s.block_size / MIN_SPLIT_TOKENS, max_blocks, 64}));
  const int64_t num_tasks = B * splits;
  std::vector<float> m(num_tasks * NQ), l(num_tasks * NQ), acc(num_tasks * NQ * D);
#pragma omp parallel for schedule(dynamic, 1) if (total_blocks * s.block_size * NQ * D >= PARALLEL_MIN_MACS)
  for (int64_t task = 0; task < num_tasks; ++task) {
    const int64_t b = task / splits;
    const int64_t split = task % splits;
    const int64_t len = context_lens[b];
    const int64_t nb = (len + s.block_size - 1) / s.block_size;
    const int64_t per_split = (nb + splits - 1) / splits;
    const int64_t blk0 = std::min(nb, split * per_split), blk1 = std::min(nb, blk0 + per_split);
    attn_task<T, ND, MAX_NG>(q + b * ldq, scale, k_cache, v_cache, tables + b * ld_tables, blk0, blk1, len, s,
                             m.data() + task * NQ, l.data() + task * NQ, acc.data() + task * NQ * D);
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < NQ; ++g) {
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, m[(b * splits + sp) * NQ + g]);
      float weights[64];
      float total = 0.0f;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t t = b * splits + sp;
        weights[sp] = l[t * NQ + g] > 0.0f ? std::exp(m[t * NQ + g] - mx) : 0.0f;
        total += weights[sp] * l[t * NQ + g];
      }
      T* dst = out + b * ld_out + g * D;
      for (int64_t d = 0; d < D; ++d) {
        float v = 0.0f;
        for (int64_t sp = 0; sp < splits; ++sp) v += weights[sp] * acc[((b * splits + sp) * NQ + g) * D + d];
        v /= total;
        if constexpr (sizeof(T) == 2) dst[d] = f2bf(v); else dst[d] = v;
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

void dp_rms_norm_bf16(const bf16* x, int64_t M, int64_t H, int64_t ldx, const bf16* w, float eps, bf16* out) {
  rms_norm(x, M, H, ldx, w, eps, out);
}
void dp_rms_norm_f32(const float* x, int64_t M, int64_t H, int64_t ldx, const float* w, float eps, float* out) {
  rms_norm(x, M, H, ldx, w, eps, out);
}
void dp_rotary_bf16(bf16* qkv, int64_t M, int64_t ld, int64_t heads, int64_t D, const float* c, const float* s) {
  rotary(qkv, M, ld, heads, D, c, s);
}
void dp_rotary_f32(float* qkv, int64_t M, int64_t ld, int64_t heads, int64_t D, const float* c, const float* s) {
  rotary(qkv, M, ld, heads, D, c, s);
}
void dp_silu_mul_bf16(const bf16* gu, int64_t M, int64_t I, bf16* out) { silu_mul(gu, M, I, out); }
void dp_silu_mul_f32(const float* gu, int64_t M, int64_t I, float* out) { silu_mul(gu, M, I, out); }

// k, v rows [T, row_elems] ld_src apart -> cache slots (rows of row_elems elements)
// Returns 0, or -1 (nothing written) when a slot is outside [0, num_slots).
int dp_kv_write(const char* k, const char* v, int64_t T, int64_t ld_src_bytes, const int64_t* slots,
                int64_t num_slots, char* k_cache, char* v_cache, int64_t row_bytes) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1;
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(k_cache + slots[t] * row_bytes, k + t * ld_src_bytes, row_bytes);
    std::memcpy(v_cache + slots[t] * row_bytes, v + t * ld_src_bytes, row_bytes);
  }
  return 0;
}

// q [B, heads * D] (rows ldq apart, bf16); caches [blocks, block_size, kv_heads, D]; tables
// [B, ld_tables] int64; context_lens [B] int64; out [B, heads * D] rows ld_out apart.
// Returns 0; -1 when head_dim is not supported (caller falls back); -2 for a bad length or block id.
int dp_decode_attention_bf16(const bf16* q, int64_t ldq, const bf16* k, const bf16* v, int64_t num_blocks,
                             const int64_t* tables,
                             int64_t ld_tables, const int64_t* lens, int64_t B, int64_t block_size,
                             int64_t kv_heads, int64_t group, int64_t D, float scale, bf16* out, int64_t ld_out) {
  const AttnShape s{block_size, kv_heads, group, D};
  switch (D) {
    case 32: return decode_attention<bf16, 1, 4>(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B, s, scale, out, ld_out);
    case 64: return decode_attention<bf16, 2, 4>(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B, s, scale, out, ld_out);
    case 128: return decode_attention<bf16, 4, 2>(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B, s, scale, out, ld_out);
    default: return -1;
  }
}

int dp_decode_attention_f32(const float* q, int64_t ldq, const float* k, const float* v, int64_t num_blocks,
                            const int64_t* tables,
                            int64_t ld_tables, const int64_t* lens, int64_t B, int64_t block_size,
                            int64_t kv_heads, int64_t group, int64_t D, float scale, float* out, int64_t ld_out) {
  const AttnShape s{block_size, kv_heads, group, D};
  switch (D) {
    case 16: return decode_attention<float, 1, 4>(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B, s, scale, out, ld_out);
    case 32: return decode_attention<float, 2, 4>(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B, s, scale, out, ld_out);
    case 64: return decode_attention<float, 4, 3>(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B, s, scale, out, ld_out);
    case 128: return decode_attention<float, 8, 1>(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B, s, scale, out, ld_out);
    default: return -1;
  }
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// one whole decoder layer for a decode-only step of at most 8 sequences (one call per layer:
// no Python between the ops, no intermediate tensors allocated)
// ---------------------------------------------------------------------------------------------

namespace {

// Static per layer (weights and this layer's cache); filled once per model and KV storage.
struct LayerArgs {
  int64_t H, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, scale;
  const void *input_norm, *qkv_w, *qkv_b, *o_w, *post_norm, *gate_up_w, *down_w;
  void *k_cache, *v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  int64_t num_blocks, block_size;
};

// Per step, shared by all layers.
struct StepArgs {
  int64_t M;
  const float *cos, *sin;  // [M, head_dim / 2]
  const int64_t* slots;    // [M]
  const int64_t* tables;   // [M, ld_tables]
  int64_t ld_tables;
  const int64_t* lens;  // [M]
  void* scratch;        // M * (H + qkv + heads * D + 2 I + I) elements
};

template <typename T, int ND, int MAX_NG>
int decode_layer(T* hidden, const LayerArgs& a, const StepArgs& st) {
  const int64_t M = st.M, H = a.H, D = a.head_dim, I = a.intermediate;
  const int64_t q_size = a.num_heads * D, kv_size = a.num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
  T* x = static_cast<T*>(st.scratch);
  T* qkv = x + M * H;
  T* attn = qkv + M * qkv_size;
  T* gate_up = attn + M * q_size;
  T* act = gate_up + M * 2 * I;
  const int64_t num_slots = a.num_blocks * a.block_size;
  for (int64_t m = 0; m < M; ++m)
    if (st.slots[m] < 0 || st.slots[m] >= num_slots) return -2;

  rms_norm(hidden, M, H, H, static_cast<const T*>(a.input_norm), a.eps, x);
  linear_impl(x, M, H, H, static_cast<const T*>(a.qkv_w), qkv_size, static_cast<const T*>(a.qkv_b),
              static_cast<const T*>(nullptr), 0, qkv, qkv_size, 0);
  rotary(qkv, M, qkv_size, a.num_heads + a.num_kv_heads, D, st.cos, st.sin);
  T* k_cache = static_cast<T*>(a.k_cache);
  T* v_cache = static_cast<T*>(a.v_cache);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(k_cache + st.slots[m] * kv_size, qkv + m * qkv_size + q_size, kv_size * sizeof(T));
    std::memcpy(v_cache + st.slots[m] * kv_size, qkv + m * qkv_size + q_size + kv_size, kv_size * sizeof(T));
  }
  const AttnShape shape{a.block_size, a.num_kv_heads, a.num_heads / a.num_kv_heads, D};
  const int status = decode_attention<T, ND, MAX_NG>(qkv, qkv_size, k_cache, v_cache, a.num_blocks, st.tables,
                                                     st.ld_tables, st.lens, M, shape, a.scale, attn, q_size);
  if (status != 0) return status;
  linear_impl(attn, M, q_size, q_size, static_cast<const T*>(a.o_w), H, static_cast<const T*>(nullptr), hidden, H,
              hidden, H, 0);
  rms_norm(hidden, M, H, H, static_cast<const T*>(a.post_norm), a.eps, x);
  linear_impl(x, M, H, H, static_cast<const T*>(a.gate_up_w), 2 * I, static_cast<const T*>(nullptr),
              static_cast<const T*>(nullptr), 0, gate_up, 2 * I, 0);
  silu_mul(gate_up, M, I, act);
  linear_impl(act, M, I, I, static_cast<const T*>(a.down_w), H, static_cast<const T*>(nullptr), hidden, H, hidden,
              H, 0);
  return 0;
}

}  // namespace

extern "C" {

// All layers of a decode step; hidden [M, H] is updated in place. Returns 0; -1 for an
// unsupported head_dim (nothing done); -2 for a slot, context length or block id out of range
// (found before anything is read or written through it).
int dp_decode_layers_bf16(bf16* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs* step) {
  for (int64_t i = 0; i < num_layers; ++i) {
    int status;
    switch (layers[i].head_dim) {
      case 32: status = decode_layer<bf16, 1, 4>(hidden, layers[i], *step); break;
      case 64: status = decode_layer<bf16, 2, 4>(hidden, layers[i], *step); break;
      case 128: status = decode_layer<bf16, 4, 2>(hidden, layers[i], *step); break;
      default: return -1;
    }
    if (status != 0) return status;
  }
  return 0;
}
int dp_decode_layers_f32(float* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs* step) {
  for (int64_t i = 0; i < num_layers; ++i) {
    int status;
    switch (layers[i].head_dim) {
      case 16: status = decode_layer<float, 1, 4>(hidden, layers[i], *step); break;
      case 32: status = decode_layer<float, 2, 4>(hidden, layers[i], *step); break;
      case 64: status = decode_layer<float, 4, 3>(hidden, layers[i], *step); break;
      case 128: status = decode_layer<float, 8, 1>(hidden, layers[i], *step); break;
      default: return -1;
    }
    if (status != 0) return status;
  }
  return 0;
}

}  // extern "C"
