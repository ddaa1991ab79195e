// The default arithmetic of quant_gemv.h for block-quantized weights and fewer than 128 rows of
// x (decode): activations rounded to int16 per 16 elements, integer dot products with the
// weights widened to int16 (_mm256_madd_epi16), float scales per block. AVX2 only; included
// by quant_gemv.h inside its AVX2 section (namespace dp_quant, after Fmt, group_scales and
// values).
//
// Why: with fp32 activations every weight is unpacked, converted and scaled in float before its
// FMA (~21 vector instructions per 32 weights at batch 1). Here a block of 32 weights costs 3
// instructions to widen (Q4: one zero-extending load, an AND, a shift), two madd + one add per
// activation row, and the per-block float work (convert, scale, accumulate) is done for 4 blocks
// at once after a horizontal add puts each block's integer sum in its own lane.
//
// Built with AVX-512 VNNI (the avx512_bf16 variant), vpdpwssd does a block half's second madd and
// the add in one instruction (4-9% faster at batch 1-4 on an Intel Xeon with AMX). Q4_K's 6-bit
// scales are decoded for a whole super-block at its first quad (QuadScales).
//
// Exactness: each half (16 floats: elements 0-7 and 16-23, or 8-15 and 24-31) of an activation
// block is stored as q = round(x / dx), dx = max|x| / 32767, so |x - dx q| <= dx / 2 = 1.5e-5 of
// the half's max (int8 per 32 would be
// 4e-3 of the block's: that changed greedy output). Scales per 16 rather than 32 cost nothing
// here (madd keeps the halves apart until the horizontal add) and halve the logit error of the
// default model, whose hidden states have single large elements in some blocks. The affine "min" term of Q4_0 / Q4_1 / Q4_K uses the sum of the rounded block, so the
// result is the dequantized weights times the rounded x, up to fp32 summation order.
// Integer sums cannot overflow: a block's half-sum (16 products) is at most 16 x 4096 x 32767 <
// 2^31 (Q6_K, whose int8 per-16 scales are folded into the int16 weights).
//
// Prepared activations, per row of x (i16_row_bytes): quads of 4 blocks; the row's int16 values
// (nq * 4 blocks of 32, zero-padded to whole quads), then per quad I16_QUAD_FLOATS floats (zero
// for padded blocks).

#pragma once

// (not standalone: quant_gemv.h includes it after the pieces it uses)
namespace dp_quant {

constexpr int64_t I16_MAX = 32767;

// Floats per quad after its int16 values: [dx_A of blocks 0..3 | dx_B of blocks 0..3 | the
// rounded blocks' sums] (A, B: quantize_block_i16).
constexpr int64_t I16_QUAD_FLOATS = 12;

inline int64_t i16_quads(int64_t K) { return (K / 32 + 3) / 4; }
inline int64_t i16_row_bytes(int64_t K) { return i16_quads(K) * (4 * 32 * 2 + I16_QUAD_FLOATS * 4); }

inline float hmax8(__m256 v) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
}

// A block of 32 floats of x rounded to int16 into q (element order), with one scale per 16
// elements, in the two sets the kernel's lanes keep apart: elements 0-7 and 16-23 ("A", the low
// 128-bit lanes of madd's results) and 8-15, 24-31 ("B"). Writes dx_A, dx_B and the sum of the
// rounded block.
inline void quantize_block_i16(const float* x, int16_t* q, float* dx_a, float* dx_b, float* sum) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const float max_a = hmax8(_mm256_max_ps(_mm256_andnot_ps(sign_bit, v[0]), _mm256_andnot_ps(sign_bit, v[2])));
  const float max_b = hmax8(_mm256_max_ps(_mm256_andnot_ps(sign_bit, v[1]), _mm256_andnot_ps(sign_bit, v[3])));
  const __m256 inv_a = _mm256_set1_ps(max_a > 0.0f ? static_cast<float>(I16_MAX) / max_a : 0.0f);
  const __m256 inv_b = _mm256_set1_ps(max_b > 0.0f ? static_cast<float>(I16_MAX) / max_b : 0.0f);
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], (i & 1) ? inv_b : inv_a), ROUND));
  // packs works per 128-bit lane: [0-3 8-11 | 4-7 12-15] -> the 64-bit parts back in order
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8));
  *dx_a = max_a / static_cast<float>(I16_MAX);
  *dx_b = max_b / static_cast<float>(I16_MAX);
  *sum = *dx_a * static_cast<float>(hsum8_epi32(_mm256_add_epi32(r[0], r[2]))) +
         *dx_b * static_cast<float>(hsum8_epi32(_mm256_add_epi32(r[1], r[3])));
}

// One row of x (K floats, a multiple of 32) into the prepared layout above. The block sums are
// of the rounded values (not of x): the min term then sees the same x as the q term, so the
// error stays sum w_i e_i with centred w_i rather than sum (d q_i) e_i with q_i >= 0.
inline void quantize_row_i16(const float* x, int64_t K, uint8_t* out) {
  const int64_t nb = K / 32, nq = i16_quads(K);
  int16_t* q = reinterpret_cast<int16_t*>(out);
  float* scales = reinterpret_cast<float*>(out + nq * 4 * 32 * 2);
  std::memset(out, 0, static_cast<size_t>(i16_row_bytes(K)));
  for (int64_t b = 0; b < nb; ++b) {
    float* quad = scales + I16_QUAD_FLOATS * (b / 4);
    quantize_block_i16(x + 32 * b, q + 32 * b, &quad[b % 4], &quad[4 + b % 4], &quad[8 + b % 4]);
  }
}

// Sub-block b (32 weights) of a weight row as int16: elements 0..15 in lo, 16..31 in hi, in the
// units the row's float scale multiplies (Q6_K: its per-16 int8 scale folded in).
template <int32_t F>
inline void load_i16(const uint8_t* row, int64_t b, __m256i* lo, __m256i* hi);

inline void nibbles_i16(const uint8_t* p, __m256i* lo, __m256i* hi) {
  // byte i holds element i (low nibble) and i + 16 (high): widened to int16, AND / shift
  const __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  *lo = _mm256_and_si256(t, _mm256_set1_epi16(15));
  *hi = _mm256_srli_epi16(t, 4);
}

template <> inline void load_i16<DP_W_Q8_0>(const uint8_t* row, int64_t b, __m256i* lo, __m256i* hi) {
  const uint8_t* g = row + b * Fmt<DP_W_Q8_0>::BYTES + 2;
  *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
  *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
}
template <> inline void load_i16<DP_W_Q4_0>(const uint8_t* row, int64_t b, __m256i* lo, __m256i* hi) {
  nibbles_i16(row + b * Fmt<DP_W_Q4_0>::BYTES + 2, lo, hi);
}
template <> inline void load_i16<DP_W_Q4_1>(const uint8_t* row, int64_t b, __m256i* lo, __m256i* hi) {
  nibbles_i16(row + b * Fmt<DP_W_Q4_1>::BYTES + 4, lo, hi);
}
template <> inline void load_i16<DP_W_Q4_K>(const uint8_t* row, int64_t b, __m256i* lo, __m256i* hi) {
  // sub-block j of a group: bytes 32 (j / 2) .. + 31 of its quants, low nibbles for even j
  const int j = static_cast<int>(b % 8);
  const uint8_t* p = row + (b / 8) * Fmt<DP_W_Q4_K>::BYTES + 16 + 32 * (j / 2);
  const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  const __m256i mask = _mm256_set1_epi16(15);
  *lo = (j & 1) ? _mm256_srli_epi16(a, 4) : _mm256_and_si256(a, mask);
  *hi = (j & 1) ? _mm256_srli_epi16(c, 4) : _mm256_and_si256(c, mask);
}
template <> inline void load_i16<DP_W_Q6_K>(const uint8_t* row, int64_t b, __m256i* lo, __m256i* hi) {
  const int j = static_cast<int>(b % 8);
  const uint8_t* g = row + (b / 8) * Fmt<DP_W_Q6_K>::BYTES;
  const __m256i v = values<DP_W_Q6_K>(g, j);  // q - 32, int8
  const int8_t* s = reinterpret_cast<const int8_t*>(g + 192);
  *lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_set1_epi16(s[2 * j]));
  *hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)), _mm256_set1_epi16(s[2 * j + 1]));
}

// [dw_b .. dw_b+3 | mw_b .. mw_b+3] of sub-blocks b .. b + count - 1 (w = dw q + mw); lanes of
// absent sub-blocks are 0. b is a multiple of 4, so the sub-blocks share one group for G = 8.
template <int32_t F>
inline __m256 scales4(const uint8_t* row, int64_t b, int count);

// fp16 pairs (d, m) at the start of `count` blocks `stride` bytes apart -> [d0..d3 | m0..m3]
inline __m256 half_pairs4(const uint8_t* p, int64_t stride, int count) {
  int32_t u[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; ++i)
    if (i < count) std::memcpy(&u[i], p + i * stride, 4);
  const __m128i pairs = _mm_setr_epi32(u[0], u[1], u[2], u[3]);  // halves d0 m0 d1 m1 ...
  const __m128i split = _mm_shuffle_epi8(pairs, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  return _mm256_cvtph_ps(split);
}

template <> inline __m256 scales4<DP_W_Q8_0>(const uint8_t* row, int64_t b, int count) {
  // Only d (signed format, no min term; the upper lanes are never read): the four fp16 scales
  // packed in one general register and moved over once, instead of half_pairs4's inserts and
  // byte shuffle, which at batch 1 compete with the widening and horizontal adds for the vector
  // shuffle pipes.
  const uint8_t* p = row + b * Fmt<DP_W_Q8_0>::BYTES;
  uint64_t d4 = 0;
  for (int i = 0; i < 4; ++i)
    if (i < count) d4 |= static_cast<uint64_t>(load_u16(p + i * Fmt<DP_W_Q8_0>::BYTES)) << (16 * i);
  const __m128 d = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(d4)));
  return _mm256_castps128_ps256(d);
}
template <> inline __m256 scales4<DP_W_Q4_0>(const uint8_t* row, int64_t b, int count) {
  const __m256 d = half_pairs4(row + b * Fmt<DP_W_Q4_0>::BYTES, Fmt<DP_W_Q4_0>::BYTES, count);
  const __m128 d4 = _mm256_castps256_ps128(d);
  return _mm256_mul_ps(_mm256_set_m128(d4, d4), _mm256_setr_ps(1, 1, 1, 1, -8, -8, -8, -8));
}
template <> inline __m256 scales4<DP_W_Q4_1>(const uint8_t* row, int64_t b, int count) {
  return half_pairs4(row + b * Fmt<DP_W_Q4_1>::BYTES, Fmt<DP_W_Q4_1>::BYTES, count);
}
template <> inline __m256 scales4<DP_W_Q4_K>(const uint8_t* row, int64_t b, int) {
  const uint8_t* g = row + (b / 8) * Fmt<DP_W_Q4_K>::BYTES;
  const float d = half_to_float(load_u16(g)), dmin = half_to_float(load_u16(g + 2));
  alignas(32) float v[8];
  for (int i = 0; i < 4; ++i) {
    int sc, mn;
    q4k_scale_min(g + 4, static_cast<int>(b % 8) + i, &sc, &mn);
    v[i] = d * static_cast<float>(sc);
    v[4 + i] = -dmin * static_cast<float>(mn);
  }
  return _mm256_load_ps(v);
}
template <> inline __m256 scales4<DP_W_Q6_K>(const uint8_t* row, int64_t b, int) {
  return _mm256_set1_ps(half_to_float(load_u16(row + (b / 8) * Fmt<DP_W_Q6_K>::BYTES + 208)));
}

// The 8 sub-blocks' float scales and mins of a Q4_K super-block at once:
// dw = d sc_j, mw = -dmin mn_j (the same values as q4k_scale_min, decoded with 32-bit masks).
inline void q4k_group_scales8(const uint8_t* g, __m256* dw, __m256* mw) {
  uint32_t u[4];
  std::memcpy(u, g + 4, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);  // mn 4..7
  const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;                                // mn 0..3
  u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);           // sc 4..7
  u[2] = mins_lo;
  u[0] &= 0x3f3f3f3fu;                                                         // sc 0..3
  const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u));
  const __m128i mn = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2));
  *dw = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)), _mm256_set1_ps(half_to_float(load_u16(g))));
  *mw = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)), _mm256_set1_ps(-half_to_float(load_u16(g + 2))));
}

// [dw_b .. dw_b+3 | mw_b .. mw_b+3] of the quad at sub-block b0, called for b0 = 0, 4, 8, ... in order
// (the K-quant super-block's scales decoded at its first quad).
template <int32_t F>
struct QuadScales {
  __m256 get(const uint8_t* row, int64_t b0, int count) { return scales4<F>(row, b0, count); }
};
template <>
struct QuadScales<DP_W_Q4_K> {
  __m256 dw8 = _mm256_setzero_ps(), mw8 = _mm256_setzero_ps();
  __m256 get(const uint8_t* row, int64_t b0, int) {
    if (b0 % 8 == 0) q4k_group_scales8(row + (b0 / 8) * Fmt<DP_W_Q4_K>::BYTES, &dw8, &mw8);
    if (b0 % 8 == 0) return _mm256_permute2f128_ps(dw8, mw8, 0x20);  // [dw 0..3 | mw 0..3]
    return _mm256_permute2f128_ps(dw8, mw8, 0x31);                   // [dw 4..7 | mw 4..7]
  }
};

// How far ahead of the quad being read its weight row is prefetched.
constexpr int64_t I16_PREFETCH_BYTES = 4096;

// out[m] = sum_k x[m, k] W[row, k] for MR prepared activation rows.
template <int32_t F, int MR>
inline void tile_i16(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
  using Spec = Fmt<F>;
  constexpr int64_t QUAD_BYTES = 4 * Spec::BYTES / Spec::G;
  const int64_t nb = K / 32, nq = i16_quads(K);
  __m256 acc[MR];
  __m128 macc[MR];
  for (int m = 0; m < MR; ++m) {
    acc[m] = _mm256_setzero_ps();
    macc[m] = _mm_setzero_ps();
  }
  QuadScales<F> quad_scales;
  for (int64_t qd = 0; qd < nq; ++qd) {
    const int64_t b0 = 4 * qd;
    const int count = static_cast<int>(std::min<int64_t>(4, nb - b0));
    // 4 KB ahead of the quad being read (30 Q8_0 quads): 1 KB was only ~7 Q8_0 quads, too close to
    // cover a DRAM miss at batch 1 (quiet A/B, Zen 3: Q8_0 decode step 12.4 vs 13.7 ms; Q4_1 equal).
    // Every 64-byte line of the quad: a Q8_0 quad is 136 bytes, so one prefetch per quad left half
    // of its lines to the hardware prefetchers.
    const char* ahead = reinterpret_cast<const char*>(row) + b0 * Spec::BYTES / Spec::G + I16_PREFETCH_BYTES;
    for (int64_t off = 0; off < QUAD_BYTES; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    __m256i wl[4], wh[4];
    for (int i = 0; i < 4; ++i) {
      if (i < count) load_i16<F>(row, b0 + i, &wl[i], &wh[i]);
      else wl[i] = wh[i] = _mm256_setzero_si256();
    }
    const __m256 ws = quad_scales.get(row, b0, count);
    const __m256 dw = _mm256_permute2f128_ps(ws, ws, 0x00);  // [dw_0..3 | dw_0..3]
    const __m128 mw = _mm256_extractf128_ps(ws, 1);
    for (int m = 0; m < MR; ++m) {
      const int16_t* xq = reinterpret_cast<const int16_t*>(arows[m]) + b0 * 32;
      __m256i s[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        s[i] = _mm256_dpwssd_epi32(_mm256_madd_epi16(wl[i], x0), wh[i], x1);  // VNNI: madd + add in one
#else
        s[i] = _mm256_add_epi32(_mm256_madd_epi16(wl[i], x0), _mm256_madd_epi16(wh[i], x1));
#endif
      }
      // lanes [sum of block i over its elements A (i = 0..3) | over its elements B]
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
      const float* xs = reinterpret_cast<const float*>(arows[m] + nq * 4 * 32 * 2) + I16_QUAD_FLOATS * qd;
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(dw, _mm256_loadu_ps(xs)), acc[m]);
      if (!Spec::SIGNED) macc[m] = _mm_fmadd_ps(mw, _mm_loadu_ps(xs + 8), macc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float v = hsum8(acc[m]);
    if (!Spec::SIGNED) {
      __m128 t = macc[m];
      t = _mm_add_ps(t, _mm_movehl_ps(t, t));
      v += _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
    out[m] = v;
  }
}

// Weight rows per pass over the activation rows: they stay in L1 while every group of 4 rows of
// x goes over them.
constexpr int64_t I16_ROWS_PER_PASS = 16;

// Below this many rows a chunk is read as one stream (rows_two_streams).
constexpr int64_t I16_TWO_STREAM_MIN_ROWS = 64;

// y[m, n - n0] for MR rows of x (arows) and rows [n0, n1) of W, the rows of the chunk's two
// halves alternating: two sequential read streams per thread instead of one. At batch 1 a
// thread's GEMV is bound by how fast one stream comes from DRAM (about 65% of a plain read's rate
// on Zen 3 for the 30 MB Q8_0 LM head); a second stream keeps more lines in flight (one thread,
// Q8_0 49152 x 576: 11-17% faster in three alternated pairs). Each row's arithmetic is unchanged,
// so the result is bitwise the one-stream order's. Used at batch 1 only: with 4 rows of x (compute-
// bound) it was not faster in the same A/B.
template <class Tile, int MR>
inline void rows_two_streams(const WeightDesc& w, const uint8_t* const* arows, int64_t n0, int64_t n1, float* y,
                             int64_t ldy) {
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  const int64_t half = (n1 - n0) / 2;
  float out[2][MR];
  for (int64_t i = 0; i < half; ++i) {
    Tile::template run<MR>(base + (n0 + i) * w.row_bytes, arows, w.K, out[0]);
    Tile::template run<MR>(base + (n0 + half + i) * w.row_bytes, arows, w.K, out[1]);
    for (int m = 0; m < MR; ++m) {
      y[m * ldy + i] = out[0][m];
      y[m * ldy + half + i] = out[1][m];
    }
  }
  for (int64_t n = n0 + 2 * half; n < n1; ++n) {  // the odd row out
    Tile::template run<MR>(base + n * w.row_bytes, arows, w.K, out[0]);
    for (int m = 0; m < MR; ++m) y[m * ldy + (n - n0)] = out[0][m];
  }
}

// y[m, n - n0] for rows [n0, n1) of W, the prepared activation rows `stride` bytes apart, by
// Tile::run<MR> (MR = 1..4 activation rows x one weight row); at batch 1 as two streams where
// Tile::TWO_STREAMS.
template <class Tile>
inline void rows_tiled(const WeightDesc& w, const uint8_t* act, int64_t stride, int64_t M, int64_t n0, int64_t n1,
                       float* y, int64_t ldy) {
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  if (Tile::TWO_STREAMS && M == 1 && n1 - n0 >= I16_TWO_STREAM_MIN_ROWS) {
    const uint8_t* const arows[4] = {act, act, act, act};
    rows_two_streams<Tile, 1>(w, arows, n0, n1, y, ldy);
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += I16_ROWS_PER_PASS) {
    const int64_t c1 = std::min(n1, c0 + I16_ROWS_PER_PASS);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const uint8_t* arows[4];
      for (int m = 0; m < 4; ++m) arows[m] = act + std::min(m0 + m, M - 1) * stride;
      const auto run = [&](auto mr) {
        constexpr int MR = decltype(mr)::value;
        float out[MR];
        for (int64_t n = c0; n < c1; ++n) {
          Tile::template run<MR>(base + n * w.row_bytes, arows, w.K, out);
          for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy + (n - n0)] = out[m];
        }
      };
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: run(Rows<1>{}); break;
        case 2: run(Rows<2>{}); break;
        case 3: run(Rows<3>{}); break;
        default: run(Rows<4>{}); break;
      }
    }
  }
}

}  // namespace dp_quant
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "quant_gemv_avx512.h"  // the fp32 tiles of the compute-bound batches
#endif
namespace dp_quant {

template <int32_t F>
struct I16Tile {
  static constexpr bool TWO_STREAMS = true;
  template <int MR>
  static void run(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
    tile_i16<F, MR>(row, arows, K, out);
  }
};

template <int32_t F>
inline void rows_i16(const WeightDesc& w, const uint8_t* act, int64_t M, int64_t n0, int64_t n1, float* y,
                     int64_t ldy) {
  rows_tiled<I16Tile<F>>(w, act, i16_row_bytes(w.K), M, n0, n1, y, ldy);
}

}  // namespace dp_quant
