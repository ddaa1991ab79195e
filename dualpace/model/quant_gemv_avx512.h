// The int16 mode of quant_gemv_i16.h on 512-bit vectors (AVX-512F + BW: the avx512 and
// avx512_bf16 variants). Included by quant_gemv_i16.h inside its AVX2 section (namespace
// dp_quant, after Fmt, values, scales4 and the prepared layout); the prepared activations, the
// rounding and the per-16 scales are the AVX2 kernel's, so the result is the same rounded x times
// the dequantized weights, in another fp32 summation order.
//
// What changes: a block of 32 weights is one register of 32 int16 (AVX2: two), so one
// _mm512_madd_epi16 per block and activation row gives its 16 pair sums, whose four 128-bit lanes
// are elements 0-7, 8-15, 16-23, 24-31, i.e. the A, B, A, B sets of the int16 rounding. Instead of
// AVX2's three horizontal adds per quad and row (6 shuffle uops on port 5), each block's sums are
// converted to float and FMA'd into one 16-lane accumulator per row with a scale vector
// [dw dxA x4 | dw dxB x4 | dw dxA x4 | dw dxB x4] (one lane permute from the quad's 8 products),
// reduced once at the end of the row. Per block and row: madd, convert, permute, FMA.
//
// VNNI (vpdpwssd) is not used: it fuses madd with an add into an integer accumulator, and here a
// block's sums are never added to another block's in integers (every block has its own float
// scales), so there is no add to fuse. Weights: Q4_0/Q4_1's 16 bytes are broadcast to both halves,
// widened once and shifted per half (vpsrlvw); Q4_K's 12 scale bytes are decoded for all 8
// sub-blocks at once per super-block (the 32-bit mask trick llama.cpp uses), not per quad and
// sub-block in scalar code; Q6_K's int8 per-16 scales are still folded into the int16 weights (one
// vpmullw per block and weight row, shared by the tile's activation rows).

#pragma once

// (not standalone: quant_gemv_i16.h includes it)
namespace dp_quant {

// Sub-block b of a weight row as 32 int16 in element order, in the units the row's float scale
// multiplies (Q6_K: its per-16 int8 scale folded in).
template <int32_t F>
inline __m512i load_i16x32(const uint8_t* row, int64_t b);

inline __m512i nibbles_i16x32(const uint8_t* p) {
  // byte i holds element i (low nibble) and i + 16 (high): both halves from one broadcast load
  const __m512i t = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(t, shift), _mm512_set1_epi16(15));
}

template <> inline __m512i load_i16x32<DP_W_Q8_0>(const uint8_t* row, int64_t b) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * Fmt<DP_W_Q8_0>::BYTES + 2)));
}
template <> inline __m512i load_i16x32<DP_W_Q4_0>(const uint8_t* row, int64_t b) {
  return nibbles_i16x32(row + b * Fmt<DP_W_Q4_0>::BYTES + 2);
}
template <> inline __m512i load_i16x32<DP_W_Q4_1>(const uint8_t* row, int64_t b) {
  return nibbles_i16x32(row + b * Fmt<DP_W_Q4_1>::BYTES + 4);
}
template <> inline __m512i load_i16x32<DP_W_Q4_K>(const uint8_t* row, int64_t b) {
  const int j = static_cast<int>(b % 8);
  const uint8_t* p = row + (b / 8) * Fmt<DP_W_Q4_K>::BYTES + 16 + 32 * (j / 2);
  const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (j & 1) ? _mm512_srli_epi16(t, 4) : _mm512_and_si512(t, _mm512_set1_epi16(15));
}
template <> inline __m512i load_i16x32<DP_W_Q6_K>(const uint8_t* row, int64_t b) {
  const int j = static_cast<int>(b % 8);
  const uint8_t* g = row + (b / 8) * Fmt<DP_W_Q6_K>::BYTES;
  const int8_t* s = reinterpret_cast<const int8_t*>(g + 192);
  const __m512i scale = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(s[2 * j])),
                                           _mm256_set1_epi16(s[2 * j + 1]), 1);
  return _mm512_mullo_epi16(_mm512_cvtepi8_epi16(values<DP_W_Q6_K>(g, j)), scale);
}

// Which formats' int16 rows take the 512-bit tile: the K-quants (Q4_K 1.8-1.9x, Q6_K 1.13-1.15x the
// 256-bit tile at batch 1, one thread, Intel Xeon with AMX). Q8_0 / Q4_0 / Q4_1 keep the 256-bit
// tile, which was faster there (the 512-bit one 0.79-0.94x at batch 1: per block and row it has
// two port-0 uops, madd and convert, where AVX2 spreads its work over three ports).
template <int32_t F>
constexpr bool I16_512_ROWS = F == DP_W_Q4_K || F == DP_W_Q6_K;

// out[m] = sum_k x[m, k] W[row, k] for MR prepared activation rows (quant_gemv_i16.h's layout).
template <int32_t F, int MR>
inline void tile_i16_512(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
  using Spec = Fmt<F>;
  constexpr int64_t QUAD_BYTES = 4 * Spec::BYTES / Spec::G;
  const int64_t nb = K / 32, nq = i16_quads(K);
  // block i's scale lanes from the quad's [dw dxA of blocks 0..3 | dw dxB of blocks 0..3]
  const __m512i pick0 = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i one = _mm512_set1_epi32(1);
  __m512 acc[MR];
  __m128 macc[MR];
  for (int m = 0; m < MR; ++m) {
    acc[m] = _mm512_setzero_ps();
    macc[m] = _mm_setzero_ps();
  }
  QuadScales<F> quad_scales;
  for (int64_t qd = 0; qd < nq; ++qd) {
    const int64_t b0 = 4 * qd;
    const int count = static_cast<int>(std::min<int64_t>(4, nb - b0));
    const char* ahead = reinterpret_cast<const char*>(row) + b0 * Spec::BYTES / Spec::G + I16_PREFETCH_BYTES;
    for (int64_t off = 0; off < QUAD_BYTES; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    __m512i wv[4];
    for (int i = 0; i < 4; ++i) wv[i] = i < count ? load_i16x32<F>(row, b0 + i) : _mm512_setzero_si512();
    const __m256 ws = quad_scales.get(row, b0, count);
    const __m256 dw = _mm256_permute2f128_ps(ws, ws, 0x00);  // [dw_0..3 | dw_0..3]
    const __m128 mw = _mm256_extractf128_ps(ws, 1);
    for (int m = 0; m < MR; ++m) {
      const int16_t* xq = reinterpret_cast<const int16_t*>(arows[m]) + b0 * 32;
      const float* xs = reinterpret_cast<const float*>(arows[m] + nq * 4 * 32 * 2) + I16_QUAD_FLOATS * qd;
      const __m512 p = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(xs)));
      __m512i pick = pick0;
      for (int i = 0; i < 4; ++i) {
        const __m512i s = _mm512_madd_epi16(wv[i], _mm512_loadu_si512(xq + 32 * i));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(pick, p), acc[m]);
        pick = _mm512_add_epi32(pick, one);
      }
      if (!Spec::SIGNED) macc[m] = _mm_fmadd_ps(mw, _mm_loadu_ps(xs + 8), macc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float v = _mm512_reduce_add_ps(acc[m]);
    if (!Spec::SIGNED) {
      __m128 t = macc[m];
      t = _mm_add_ps(t, _mm_movehl_ps(t, t));
      v += _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
    out[m] = v;
  }
}

}  // namespace dp_quant

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
