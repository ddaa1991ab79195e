// Linear layers on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), kept in the
// file's own block layout. The contract (namespace dp_quant: supported, prepare_bytes, prepare,
// rows) is the one dualpace/model/KERNELS.md describes; cpu_kernels.cpp includes this header
// once per ISA variant, and quant_kernels.cpp wraps it in extern "C" functions of its own.
//
// The arithmetic of the activations, per process (dp_quant_set_activations; the engines set it
// from --quant-activations: int8, their default, or exact = int16):
// - `int16` (the exact mode, and the library's mode until set): activations rounded to int16 per 16
//   elements and integer dot products with the weights widened to int16 (quant_gemv_i16.h). The
//   rounding is 1.5e-5 of each 16's max, finer than bf16 activations: greedy output matches the
//   dequantized fp32 model. In AVX-512 builds the standalone library's calls with >= 8 rows of x
//   compute as `fp32` instead (quant_gemv_avx512.h: faster there).
// - `int8`: from VNNI_MIN_ROWS rows of x in builds with AVX-512 VNNI, activations quantized per
//   row per 16 elements to int8 (one float scale per 16: half llama.cpp's q8_0 block) and
//   multiplied with vpdpbusd (quant_gemv_vnni.h; rows with outlier channels rounded twice, the
//   residual in a lane of its own); the K-quant formats (Q4_K, Q6_K) from Q8K_MAX_ROWS + 1 and
//   Q8_0 / Q4_0 from PAIRS_MAX_ROWS + 1. Fewer rows of the K-quants are rounded per super-block
//   of 256 and summed in integers (quant_gemv_q8k.h), fewer of Q8_0 / Q4_0 per 16, two blocks to
//   a pair of vectors (quant_gemv_block_pairs.h), both in int16 where a row is an outlier; fewer
//   rows of Q4_1, or a build without VNNI, compute as int16. The activation rounding (4e-3 of each 16's max) moves logits by ~1e-2
//   relative: close to the dequantized model by KL divergence (docs/perf.md), not greedy-identical
//   to it.
// - `fp32`: each 8-weight chunk is unpacked and dequantized in registers to fp32
//   (scale x q + min) and FMA'd with the fp32 activations. The result equals the dequantized fp32
//   model up to summation order (the tests' reference).
// Measured and removed (docs/perf.md): int8 on AVX2 with maddubs on tiles of 4 rows x 2 weight
// rows (0.76-0.94x of int16 for Q8_0 at batch 1-32 on an Intel Xeon forced to the avx2 build,
// 1.02-1.12x for Q4_K), and `int16-split`, Q8_0's activations split in two bytes for maddubs
// (0.85-0.93x there; no faster on an AVX2 Zen 3).
// In fp32 a tile of several activation rows x 2 or 4 weight rows reuses every unpacked weight
// vector for all the tile's rows; int16 reuses them over tiles of 4 rows.
// The prepared activations start with a 64-byte header naming the mode they were made in, so a
// mode change between two calls never mixes layouts.
//
// Without AVX2 (the generic variant) each block is dequantized to float and dotted with the
// fp32 activations (prepare_bytes = 0).
//
// Block layouts (GGML's): Q8_0 {fp16 d; int8 q[32]}, w = d q. Q4_0 {fp16 d; uint8 q[16]},
// w = d (q - 8), byte i holds element i (low nibble) and i + 16 (high). Q4_1 {fp16 d, m; q[16]},
// w = d q + m. Q4_K: 256 weights {fp16 d, dmin; 12 bytes of 6-bit scales/mins for 8 sub-blocks
// of 32; q[128]}, w = d sc_j q - dmin mn_j, bytes 32p..32p+31 hold sub-block 2p (low nibbles)
// and 2p+1 (high). Q6_K: 256 weights {ql[128]; qh[64]; int8 scales[16]; fp16 d},
// w = d scale_(i/16) (q - 32), q = 4 bits of ql | 2 bits of qh << 4.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernel_weights.h"

namespace dp_quant {

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while (!(mant & 0x400u)) { mant <<= 1; --exp; }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K super-block's 12 scale bytes.
inline void q4k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Static description of each format: sub-blocks of 32 per group (a group is one GGML block),
// the group's bytes, and whether the values are signed (sign trick) or unsigned with a min term.
template <int32_t F> struct Fmt;
template <> struct Fmt<DP_W_Q8_0> { static constexpr int G = 1, BYTES = 34; static constexpr bool SIGNED = true; };
template <> struct Fmt<DP_W_Q4_0> { static constexpr int G = 1, BYTES = 18; static constexpr bool SIGNED = false; };
template <> struct Fmt<DP_W_Q4_1> { static constexpr int G = 1, BYTES = 20; static constexpr bool SIGNED = false; };
template <> struct Fmt<DP_W_Q4_K> { static constexpr int G = 8, BYTES = 144; static constexpr bool SIGNED = false; };
template <> struct Fmt<DP_W_Q6_K> { static constexpr int G = 8, BYTES = 210; static constexpr bool SIGNED = true; };

inline bool supported(int32_t format) {
  return format == DP_W_Q8_0 || format == DP_W_Q4_0 || format == DP_W_Q4_1 || format == DP_W_Q4_K ||
         format == DP_W_Q6_K;
}

inline int64_t group_elems(int32_t format) { return (format == DP_W_Q4_K || format == DP_W_Q6_K) ? 256 : 32; }

// Per group: the float scale dw[j] and min mw[j] of each sub-block j (w = dw q + mw for unsigned
// formats, w = dw q for signed ones; Q6_K's per-16 integer scales are applied in the integer dot).
template <int32_t F>
inline void group_scales(const uint8_t* g, float* dw, float* mw);

template <> inline void group_scales<DP_W_Q8_0>(const uint8_t* g, float* dw, float* mw) {
  dw[0] = half_to_float(load_u16(g));
  mw[0] = 0.0f;
}
template <> inline void group_scales<DP_W_Q4_0>(const uint8_t* g, float* dw, float* mw) {
  dw[0] = half_to_float(load_u16(g));
  mw[0] = -8.0f * dw[0];
}
template <> inline void group_scales<DP_W_Q4_1>(const uint8_t* g, float* dw, float* mw) {
  dw[0] = half_to_float(load_u16(g));
  mw[0] = half_to_float(load_u16(g + 2));
}
template <> inline void group_scales<DP_W_Q4_K>(const uint8_t* g, float* dw, float* mw) {
  const float d = half_to_float(load_u16(g)), dmin = half_to_float(load_u16(g + 2));
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    q4k_scale_min(g + 4, j, &sc, &mn);
    dw[j] = d * static_cast<float>(sc);
    mw[j] = -dmin * static_cast<float>(mn);
  }
}
template <> inline void group_scales<DP_W_Q6_K>(const uint8_t* g, float* dw, float* mw) {
  const float d = half_to_float(load_u16(g + 208));
  for (int j = 0; j < 8; ++j) {
    dw[j] = d;
    mw[j] = 0.0f;
  }
}

// Scalar value of element e (0..group_elems) of a group, as the integer the scale multiplies
// (Q6_K: including its per-16 scale), for the generic path and for dequantize_row.
template <int32_t F>
inline int element(const uint8_t* g, int e);
template <> inline int element<DP_W_Q8_0>(const uint8_t* g, int e) { return static_cast<int8_t>(g[2 + e]); }
template <> inline int element<DP_W_Q4_0>(const uint8_t* g, int e) {
  return e < 16 ? (g[2 + e] & 15) : (g[2 + e - 16] >> 4);
}
template <> inline int element<DP_W_Q4_1>(const uint8_t* g, int e) {
  return e < 16 ? (g[4 + e] & 15) : (g[4 + e - 16] >> 4);
}
template <> inline int element<DP_W_Q4_K>(const uint8_t* g, int e) {
  const int j = e / 32, i = e % 32;
  const uint8_t b = g[16 + 32 * (j / 2) + i];
  return (j & 1) ? (b >> 4) : (b & 15);
}
template <> inline int element<DP_W_Q6_K>(const uint8_t* g, int e) {
  const int h = e / 128, r = e % 128;
  const uint8_t lo = g[h * 64 + r % 64], hi = g[128 + h * 32 + r % 32];
  const int q = ((r / 64) ? (lo >> 4) : (lo & 15)) | (((hi >> (2 * (r / 32))) & 3) << 4);
  return (q - 32) * static_cast<int8_t>(g[192 + e / 16]);
}

template <int32_t F>
inline void dequantize_group(const uint8_t* g, float* out) {
  float dw[8], mw[8];
  group_scales<F>(g, dw, mw);
  for (int e = 0; e < 32 * Fmt<F>::G; ++e) out[e] = dw[e / 32] * static_cast<float>(element<F>(g, e)) + mw[e / 32];
}

template <int32_t F>
inline void dequantize_row_t(const uint8_t* row, int64_t K, float* out);  // below, per ISA

// The arithmetic for activations (see the top of this file).
enum ActivationMode : int32_t { ACT_FP32 = 0, ACT_INT16 = 1, ACT_INT8 = 2 };

inline std::atomic<int32_t>& activation_mode_slot() {
  static std::atomic<int32_t> mode{ACT_INT16};
  return mode;
}

inline int32_t activation_mode() { return activation_mode_slot().load(std::memory_order_relaxed); }

// Sets the mode for later calls (an unknown value is ignored); returns the mode now in force.
inline int32_t set_activation_mode(int32_t mode) {
  if (mode >= ACT_FP32 && mode <= ACT_INT8) activation_mode_slot().store(mode);
  return activation_mode();
}

// Scale and min of each run of 16 elements of a group (2 G entries): Q6_K's own per-16 scales,
// the sub-block's for the other formats.
template <int32_t F>
inline void group_scales16(const uint8_t* g, float* dw16, float* mw16) {
  float dw[8], mw[8];
  group_scales<F>(g, dw, mw);
  for (int j = 0; j < Fmt<F>::G; ++j) {
    dw16[2 * j] = dw16[2 * j + 1] = dw[j];
    mw16[2 * j] = mw16[2 * j + 1] = mw[j];
  }
}
template <> inline void group_scales16<DP_W_Q6_K>(const uint8_t* g, float* dw16, float* mw16) {
  const float d = half_to_float(load_u16(g + 208));
  for (int i = 0; i < 16; ++i) {
    dw16[i] = d * static_cast<float>(reinterpret_cast<const int8_t*>(g + 192)[i]);
    mw16[i] = 0.0f;
  }
}

#if defined(__AVX2__)

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 values of sub-block j of a group, as bytes: unsigned (0..15) for Q4 formats, signed for
// Q8_0 and Q6_K (Q6_K: q - 32, without its per-16 integer scales).
template <int32_t F>
inline __m256i values(const uint8_t* g, int j);

inline __m256i nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

template <> inline __m256i values<DP_W_Q8_0>(const uint8_t* g, int) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 2));
}
template <> inline __m256i values<DP_W_Q4_0>(const uint8_t* g, int) { return nibbles16(g + 2); }
template <> inline __m256i values<DP_W_Q4_1>(const uint8_t* g, int) { return nibbles16(g + 4); }
template <> inline __m256i values<DP_W_Q4_K>(const uint8_t* g, int j) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 16 + 32 * (j / 2)));
  return _mm256_and_si256((j & 1) ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
}
template <> inline __m256i values<DP_W_Q6_K>(const uint8_t* g, int j) {
  const int h = j / 4, c = j % 4;
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + h * 64 + (c % 2) * 32));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 128 + h * 32));
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  const __m256i l4 = _mm256_and_si256(c >= 2 ? _mm256_srli_epi16(lo, 4) : lo, m4);
  const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * c), m2);
  return _mm256_sub_epi8(_mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)), _mm256_set1_epi8(32));
}

// Activation rows per pass over a chunk of weight rows: the pass's fp32 rows stay in L2.
constexpr int64_t ROWS_PER_PASS = 64;

template <int M> using Rows = std::integral_constant<int, M>;

// Calls run(Rows<MR>, Rows<NR>, m0) over tiles covering rows [0, M): passes of ROWS_PER_PASS rows,
// 4 x 2 tiles with a 3/2/1-row tail, and one 1 x 4 tile for a lone row.
template <typename Run>
inline void for_row_tiles(int64_t M, Run run) {
  for (int64_t p0 = 0; p0 < M; p0 += ROWS_PER_PASS) {
    const int64_t p1 = std::min(M, p0 + ROWS_PER_PASS);
    int64_t m = p0;
    if (p1 - p0 == 1) {
      run(Rows<1>{}, Rows<4>{}, m);
      continue;
    }
    for (; m + 4 <= p1; m += 4) run(Rows<4>{}, Rows<2>{}, m);
    switch (p1 - m) {
      case 3: run(Rows<3>{}, Rows<2>{}, m); break;
      case 2: run(Rows<2>{}, Rows<2>{}, m); break;
      case 1: run(Rows<1>{}, Rows<2>{}, m); break;
      default: break;
    }
  }
}

// ---- fp32 activations: weights dequantized in registers, 8 at a time ----

// Elements 8c..8c+7 of a sub-block's 32 byte values as fp32.
template <bool SIGNED>
inline __m256 chunk_f32(__m256i v, int c) {
  const __m128i half = (c < 2) ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
  const __m128i part = (c & 1) ? _mm_srli_si128(half, 8) : half;
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part));
}

template <int32_t F, int MR, int NR>
inline void tile_f32(const uint8_t* const* wrows, const float* x, int64_t ldx, int64_t K, float (*out)[NR]) {
  using Spec = Fmt<F>;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t num_groups = K / (32 * Spec::G);
  for (int64_t grp = 0; grp < num_groups; ++grp) {
    float dw[NR][16], mw[NR][16];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* g = wrows[r] + grp * Spec::BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(g) + 1024, _MM_HINT_T0);
      group_scales16<F>(g, dw[r], mw[r]);
    }
    for (int j = 0; j < Spec::G; ++j) {
      __m256i wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = values<F>(wrows[r] + grp * Spec::BYTES, j);
      const float* xb = x + (grp * Spec::G + j) * 32;
      for (int c = 0; c < 4; ++c) {
        __m256 wf[NR];
        for (int r = 0; r < NR; ++r) {
          const __m256 q = chunk_f32<Spec::SIGNED>(wv[r], c), d = _mm256_set1_ps(dw[r][2 * j + c / 2]);
          wf[r] = Spec::SIGNED ? _mm256_mul_ps(q, d) : _mm256_fmadd_ps(q, d, _mm256_set1_ps(mw[r][2 * j + c / 2]));
        }
        for (int m = 0; m < MR; ++m) {
          const __m256 xv = _mm256_loadu_ps(xb + m * ldx + 8 * c);
          for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(wf[r], xv, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = hsum8(acc[m][r]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int32_t F, int MR, int NR>  // quant_gemv_avx512.h
inline void tile_f32_512(const uint8_t* const* wrows, const float* x, int64_t ldx, int64_t K, float (*out)[NR]);
#endif

// WIDE: by tile_f32_512 (AVX-512 builds only).
template <int32_t F, int MR, int NR, bool WIDE = false>
inline void rows_tile_f32(const WeightDesc& w, const float* x, int64_t ldx, int64_t m0, int64_t n0, int64_t n1,
                          float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; n += NR) {
    const uint8_t* wrows[NR];
    for (int r = 0; r < NR; ++r)
      wrows[r] = static_cast<const uint8_t*>(w.data) + std::min(n + r, n1 - 1) * w.row_bytes;
    float out[MR][NR];
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if constexpr (WIDE) tile_f32_512<F, MR, NR>(wrows, x + m0 * ldx, ldx, w.K, out);
    else
#endif
      tile_f32<F, MR, NR>(wrows, x + m0 * ldx, ldx, w.K, out);
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR && n + r < n1; ++r) y[(m0 + m) * ldy + (n - n0 + r)] = out[m][r];
  }
}

template <int32_t F>
inline void rows_f32_t(const WeightDesc& w, const float* x, int64_t M, int64_t ldx, int64_t n0, int64_t n1, float* y,
                       int64_t ldy) {
  for_row_tiles(M, [&](auto mr, auto nr, int64_t m0) {
    rows_tile_f32<F, decltype(mr)::value, decltype(nr)::value>(w, x, ldx, m0, n0, n1, y, ldy);
  });
}

}  // namespace dp_quant
#include "quant_gemv_i16.h"  // the int16 mode (uses the pieces above)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DP_QUANT_VNNI 1
#include "quant_gemv_vnni.h"       // the int8 mode's tiles
#include "quant_gemv_vnni_rows.h"  // and its loop over them
#include "quant_gemv_q8k.h"        // the int8 mode's K-quant rows up to Q8K_MAX_ROWS
#include "quant_gemv_block_pairs.h"  // and its Q8_0 / Q4_0 rows up to PAIRS_MAX_ROWS
#endif
namespace dp_quant {

// The layouts a prepared header names: ACT_FP32 (none), ACT_INT16, or the int8 mode's layouts:
// for vpdpbusd (quant_gemv_vnni.h: activation rows in the vector lanes) and, for the K-quant
// formats up to Q8K_MAX_ROWS rows, rows rounded per super-block (quant_gemv_q8k.h), for Q8_0 /
// Q4_0 up to PAIRS_MAX_ROWS rows, rows rounded per 16 in pair order (quant_gemv_block_pairs.h).
constexpr int32_t PREPARED_VNNI = 17;
constexpr int32_t PREPARED_Q8K = 18;
constexpr int32_t PREPARED_PAIRS = 19;

#if defined(DP_QUANT_VNNI)
// Rows of x from which the int8 mode runs quant_gemv_vnni.h's lane groups for this format.
inline int64_t int8_lanes_min_rows(int32_t format) {
  return q8k_format(format) ? Q8K_MAX_ROWS + 1 : pairs_format(format) ? PAIRS_MAX_ROWS + 1 : VNNI_MIN_ROWS;
}
#endif

// Rows of x from which the int16 mode computes in fp32 instead (quant_gemv_avx512.h); never on AVX2.
inline int64_t fp32_min_rows() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return F32_512_MIN_ROWS;
#else
  return INT64_MAX;
#endif
}

// The prepared activations: a header (the mode, padded to 64 bytes) and the mode's rows.
constexpr int64_t PREPARED_HEADER_BYTES = 64;

// Enough for either integer layout, whatever the mode, so that a mode
// change between prepare_bytes and prepare cannot overrun the buffer.
inline int64_t prepare_bytes(const WeightDesc& w, int64_t M) {
  const int64_t rows = M * i16_row_bytes(w.K);
#if defined(DP_QUANT_VNNI)
  return PREPARED_HEADER_BYTES + std::max({rows, vnni_prepared_bytes(w.K, M), M * q8k_row_bytes(w.K),
                                              M * pairs_row_bytes(w.K, w.format)});
#else
  return PREPARED_HEADER_BYTES + rows;
#endif
}

// Quantizes x as the mode in force asks and writes the layout it made into the header for rows().
// fp32_switch: whether the int16 mode may compute in fp32 from fp32_min_rows() rows. The engine
// (cpu_kernels.cpp) passes false: the switch changes the activations' arithmetic at a batch size, so
// a row's output would depend on how many rows share its call (tests/model/test_batch_invariance.py).
// (With it on, bf16 compute once changed the default model's chat answer: not a fault of these
// tiles but a near tie of the model's first answer token, margin 0.08 logits.)
// The int8 mode has no such invariance: below int8_lanes_min_rows it rounds K-quant calls per
// super-block and Q8_0 / Q4_0 calls per 16 (without an outlier row) and computes the others in
// int16; without VNNI, int16.
inline void prepare(const WeightDesc& w, const float* x, int64_t M, int64_t ldx, void* prepared,
                    bool fp32_switch = true) {
  uint8_t* out = static_cast<uint8_t*>(prepared);
  int32_t mode = activation_mode();
  uint8_t* body = out + PREPARED_HEADER_BYTES;
#if defined(DP_QUANT_VNNI)
  if (mode == ACT_INT8 && M >= int8_lanes_min_rows(w.format)) {
    mode = PREPARED_VNNI;
    prepare_vnni(x, M, ldx, w.K, w.format, body);
  } else if (mode == ACT_INT8 && q8k_applies(w, x, M, ldx)) {
    mode = PREPARED_Q8K;
    prepare_q8k(x, M, ldx, w.K, body);
  } else if (mode == ACT_INT8 && pairs_apply(w, x, M, ldx)) {
    mode = PREPARED_PAIRS;
    prepare_pairs(w, x, M, ldx, body);
  } else
#endif
  if (mode == ACT_FP32 || (fp32_switch && M >= fp32_min_rows())) {
    mode = ACT_FP32;  // AVX-512: the fp32 tiles beat the int16 ones on compute-bound batches
  } else {
    mode = ACT_INT16;
    for (int64_t m = 0; m < M; ++m) quantize_row_i16(x + m * ldx, w.K, body + m * i16_row_bytes(w.K));
  }
  std::memcpy(out, &mode, sizeof(mode));
}

inline void rows(const WeightDesc& w, const float* x, int64_t M, int64_t ldx, const void* prepared, int64_t n0,
                 int64_t n1, float* y, int64_t ldy) {
  int32_t mode;
  std::memcpy(&mode, prepared, sizeof(mode));
  const uint8_t* body = static_cast<const uint8_t*>(prepared) + PREPARED_HEADER_BYTES;
#if defined(DP_QUANT_VNNI)
#define DP_QUANT_VNNI_ROWS(F)                                                    \
  ((mode == PREPARED_VNNI && (rows_vnni<F>(w, body, n0, n1, y, ldy), true)) || \
   (mode == PREPARED_Q8K && rows_q8k<F>(w, body, M, n0, n1, y, ldy)) ||          \
   (mode == PREPARED_PAIRS && rows_pairs<F>(w, body, M, n0, n1, y, ldy)))
#else
#define DP_QUANT_VNNI_ROWS(F) false
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DP_QUANT_ROWS_F32(F) rows_f32_512_t<F>(w, x, M, ldx, n0, n1, y, ldy)
#else
#define DP_QUANT_ROWS_F32(F) rows_f32_t<F>(w, x, M, ldx, n0, n1, y, ldy)
#endif
  switch (w.format) {
#define DP_QUANT_CASE(F)                                            \
  case F:                                                           \
    if (mode == ACT_INT16) rows_i16<F>(w, body, M, n0, n1, y, ldy); \
    else if (!DP_QUANT_VNNI_ROWS(F)) DP_QUANT_ROWS_F32(F);          \
    break;
    DP_QUANT_CASE(DP_W_Q8_0)
    DP_QUANT_CASE(DP_W_Q4_0)
    DP_QUANT_CASE(DP_W_Q4_1)
    DP_QUANT_CASE(DP_W_Q4_K)
    DP_QUANT_CASE(DP_W_Q6_K)
#undef DP_QUANT_CASE
#undef DP_QUANT_ROWS_F32
#undef DP_QUANT_VNNI_ROWS
    default: break;
  }
}

template <int32_t F>
inline void dequantize_row_t(const uint8_t* row, int64_t K, float* out) {
  using Spec = Fmt<F>;
  for (int64_t grp = 0; grp < K / (32 * Spec::G); ++grp) {
    const uint8_t* g = row + grp * Spec::BYTES;
    float dw[16], mw[16];
    group_scales16<F>(g, dw, mw);
    for (int j = 0; j < Spec::G; ++j) {
      const __m256i wv = values<F>(g, j);
      float* o = out + (grp * Spec::G + j) * 32;
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(chunk_f32<Spec::SIGNED>(wv, c), _mm256_set1_ps(dw[2 * j + c / 2]),
                                                      _mm256_set1_ps(mw[2 * j + c / 2])));
    }
  }
}

#else  // no AVX2: dequantize each group to float and dot it with the fp32 activations

inline int64_t prepare_bytes(const WeightDesc&, int64_t) { return 0; }
inline void prepare(const WeightDesc&, const float*, int64_t, int64_t, void*, bool = true) {}
inline int64_t fp32_min_rows() { return INT64_MAX; }

template <int32_t F>
inline void dequantize_row_t(const uint8_t* row, int64_t K, float* out) {
  const int64_t ge = 32 * Fmt<F>::G;
  for (int64_t g = 0; g < K / ge; ++g) dequantize_group<F>(row + g * Fmt<F>::BYTES, out + g * ge);
}

template <int32_t F>
inline void rows_t(const WeightDesc& w, const float* x, int64_t M, int64_t ldx, int64_t n0, int64_t n1, float* y,
                   int64_t ldy) {
  const int64_t ge = 32 * Fmt<F>::G;
  float buf[256];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + n * w.row_bytes;
    for (int64_t m = 0; m < M; ++m) y[m * ldy + (n - n0)] = 0.0f;
    for (int64_t g = 0; g < w.K / ge; ++g) {
      dequantize_group<F>(row + g * Fmt<F>::BYTES, buf);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * ldx + g * ge;
        float s = 0.0f;
        for (int64_t e = 0; e < ge; ++e) s += buf[e] * xm[e];
        y[m * ldy + (n - n0)] += s;
      }
    }
  }
}

inline void rows(const WeightDesc& w, const float* x, int64_t M, int64_t ldx, const void*, int64_t n0, int64_t n1,
                 float* y, int64_t ldy) {
  switch (w.format) {
    case DP_W_Q8_0: rows_t<DP_W_Q8_0>(w, x, M, ldx, n0, n1, y, ldy); break;
    case DP_W_Q4_0: rows_t<DP_W_Q4_0>(w, x, M, ldx, n0, n1, y, ldy); break;
    case DP_W_Q4_1: rows_t<DP_W_Q4_1>(w, x, M, ldx, n0, n1, y, ldy); break;
    case DP_W_Q4_K: rows_t<DP_W_Q4_K>(w, x, M, ldx, n0, n1, y, ldy); break;
    case DP_W_Q6_K: rows_t<DP_W_Q6_K>(w, x, M, ldx, n0, n1, y, ldy); break;
    default: break;
  }
}

#endif

// One row of W (K elements) as float32. Returns false for a format this header does not know.
inline bool dequantize_row(int32_t format, const void* row, int64_t K, float* out) {
  const uint8_t* r = static_cast<const uint8_t*>(row);
  switch (format) {
    case DP_W_Q8_0: dequantize_row_t<DP_W_Q8_0>(r, K, out); return true;
    case DP_W_Q4_0: dequantize_row_t<DP_W_Q4_0>(r, K, out); return true;
    case DP_W_Q4_1: dequantize_row_t<DP_W_Q4_1>(r, K, out); return true;
    case DP_W_Q4_K: dequantize_row_t<DP_W_Q4_K>(r, K, out); return true;
    case DP_W_Q6_K: dequantize_row_t<DP_W_Q6_K>(r, K, out); return true;
    default: return false;
  }
}

}  // namespace dp_quant
