// 512-bit rows for block-quantized weights (AVX-512F + BW: the avx512 and avx512_bf16 variants,
// and generic where -march=native has them). Included by quant_gemv_i16.h inside its AVX2 section
// (namespace dp_quant, after Fmt, values, group_scales16).
//
// What is here: fp32 tiles of 8 activation rows x 2 weight rows, used by the fp32 mode and by the
// int16 mode from F32_512_MIN_ROWS rows of x (quant_gemv.h's prepare() then names ACT_FP32).
// Below that the int16 mode keeps quant_gemv_i16.h's 256-bit tile, compiled with the variant's
// flags (32 vector registers, EVEX encodings; with VNNI, vpdpwssd fuses its madd + add).
//
// Why not a 512-bit int16 tile: one was written (one register of 32 int16 per block, madd,
// convert, a lane permute for the per-16 scales, FMA into a 16-lane accumulator) and measured
// against the 256-bit tile on an Intel Xeon with AMX, one thread: Q8_0 / Q4_1 0.79-0.94x at
// batch 1; Q4_K / Q6_K 0.83-1.08x once the 256-bit tile had VNNI and Q4_K's scales were decoded
// once per super-block. Per block and activation row it needs a madd and a convert (both port 0
// on these cores, by the published uop tables; not profiled here) that no wider register removes, since every block's integer sums need their own float scales.
// The fp32 tile avoids that per-row work: the weights are
// unpacked and scaled once per tile, and each activation row costs two FMAs per sub-block.

#pragma once

// (not standalone: quant_gemv_i16.h includes it)
// ---- fp32 activations on 512-bit vectors: the compute-bound batches ----
//
// Each weight sub-block is unpacked and scaled to two registers of 16 floats once per tile, and
// each activation row then costs two FMAs per sub-block: no per-row integer-to-float conversion
// or scale product, which is what bounds the int16 kernels (madd, convert, scale, FMA per block
// and row, port 0 on Intel cores). Tiles of 8 activation rows x 2 weight rows (16 accumulators of
// the 32 registers). The result equals the dequantized fp32 weights times x up to summation order.
namespace dp_quant {

// The 32 values of sub-block j of a group as floats (elements 0-15 in lo, 16-31 in hi), as the
// integers the scales multiply (Q6_K: q - 32, before its per-16 scale).
template <int32_t F>
inline void values_f32_512(const uint8_t* g, int j, __m512* lo, __m512* hi);

inline __m512i load_u8_epi32(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void nibbles_f32_512(const uint8_t* p, __m512* lo, __m512* hi) {
  const __m512i t = load_u8_epi32(p);
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(t, _mm512_set1_epi32(15)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(t, 4));
}
template <> inline void values_f32_512<DP_W_Q8_0>(const uint8_t* g, int, __m512* lo, __m512* hi) {
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 2))));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 18))));
}
template <> inline void values_f32_512<DP_W_Q4_0>(const uint8_t* g, int, __m512* lo, __m512* hi) {
  nibbles_f32_512(g + 2, lo, hi);
}
template <> inline void values_f32_512<DP_W_Q4_1>(const uint8_t* g, int, __m512* lo, __m512* hi) {
  nibbles_f32_512(g + 4, lo, hi);
}
template <> inline void values_f32_512<DP_W_Q4_K>(const uint8_t* g, int j, __m512* lo, __m512* hi) {
  const uint8_t* p = g + 16 + 32 * (j / 2);
  const __m512i a = load_u8_epi32(p), c = load_u8_epi32(p + 16), mask = _mm512_set1_epi32(15);
  *lo = _mm512_cvtepi32_ps((j & 1) ? _mm512_srli_epi32(a, 4) : _mm512_and_si512(a, mask));
  *hi = _mm512_cvtepi32_ps((j & 1) ? _mm512_srli_epi32(c, 4) : _mm512_and_si512(c, mask));
}
template <> inline void values_f32_512<DP_W_Q6_K>(const uint8_t* g, int j, __m512* lo, __m512* hi) {
  const __m256i v = values<DP_W_Q6_K>(g, j);
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
}

template <int32_t F, int MR, int NR>
inline void tile_f32_512(const uint8_t* const* wrows, const float* x, int64_t ldx, int64_t K, float (*out)[NR]) {
  using Spec = Fmt<F>;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t num_groups = K / (32 * Spec::G);
  for (int64_t grp = 0; grp < num_groups; ++grp) {
    float dw[NR][16], mw[NR][16];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* g = wrows[r] + grp * Spec::BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(g) + 1024, _MM_HINT_T0);
      group_scales16<F>(g, dw[r], mw[r]);
    }
    for (int j = 0; j < Spec::G; ++j) {
      __m512 wlo[NR], whi[NR];
      for (int r = 0; r < NR; ++r) {
        __m512 lo, hi;
        values_f32_512<F>(wrows[r] + grp * Spec::BYTES, j, &lo, &hi);
        const __m512 d0 = _mm512_set1_ps(dw[r][2 * j]), d1 = _mm512_set1_ps(dw[r][2 * j + 1]);
        wlo[r] = Spec::SIGNED ? _mm512_mul_ps(lo, d0) : _mm512_fmadd_ps(lo, d0, _mm512_set1_ps(mw[r][2 * j]));
        whi[r] = Spec::SIGNED ? _mm512_mul_ps(hi, d1) : _mm512_fmadd_ps(hi, d1, _mm512_set1_ps(mw[r][2 * j + 1]));
      }
      const float* xb = x + (grp * Spec::G + j) * 32;
      for (int m = 0; m < MR; ++m) {
        const __m512 xl = _mm512_loadu_ps(xb + m * ldx), xh = _mm512_loadu_ps(xb + m * ldx + 16);
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_fmadd_ps(whi[r], xh, _mm512_fmadd_ps(wlo[r], xl, acc[m][r]));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

// From this many rows of x a linear call in the int16 mode computes with the fp32 activations
// (prepare() names ACT_FP32 in the header): exact, and 1.24-1.56x the 256-bit int16 kernels at
// batch 8 on every format (one thread, Intel Xeon with AMX); at batch 4 they were about even.
constexpr int64_t F32_512_MIN_ROWS = 8;

// Activation rows per pass over a chunk of weight rows (their fp32 rows stay in L2).
constexpr int64_t F32_512_ROWS_PER_PASS = 64;

template <int32_t F>
inline void rows_f32_512_t(const WeightDesc& w, const float* x, int64_t M, int64_t ldx, int64_t n0, int64_t n1,
                           float* y, int64_t ldy) {
  for (int64_t p0 = 0; p0 < M; p0 += F32_512_ROWS_PER_PASS) {
    const int64_t p1 = std::min(M, p0 + F32_512_ROWS_PER_PASS);
    if (p1 - p0 == 1) {
      rows_tile_f32<F, 1, 4, true>(w, x, ldx, p0, n0, n1, y, ldy);
      continue;
    }
    int64_t m = p0;
    for (; m + 8 <= p1; m += 8) rows_tile_f32<F, 8, 2, true>(w, x, ldx, m, n0, n1, y, ldy);
    switch (p1 - m) {
      case 7: rows_tile_f32<F, 7, 2, true>(w, x, ldx, m, n0, n1, y, ldy); break;
      case 6: rows_tile_f32<F, 6, 2, true>(w, x, ldx, m, n0, n1, y, ldy); break;
      case 5: rows_tile_f32<F, 5, 2, true>(w, x, ldx, m, n0, n1, y, ldy); break;
      case 4: rows_tile_f32<F, 4, 2, true>(w, x, ldx, m, n0, n1, y, ldy); break;
      case 3: rows_tile_f32<F, 3, 2, true>(w, x, ldx, m, n0, n1, y, ldy); break;
      case 2: rows_tile_f32<F, 2, 2, true>(w, x, ldx, m, n0, n1, y, ldy); break;
      case 1: rows_tile_f32<F, 1, 2, true>(w, x, ldx, m, n0, n1, y, ldy); break;
      default: break;
    }
  }
}

}  // namespace dp_quant
