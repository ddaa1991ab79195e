// The int8 mode's rows for the K-quant formats (Q4_K, Q6_K) up to Q8K_MAX_ROWS rows of x, in
// builds with AVX-512 VNNI: the decode batches 1-8, where the lane-group layout of
// quant_gemv_vnni.h has too few rows to fill its lanes. Included by quant_gemv.h after
// quant_gemv_vnni.h (namespace dp_quant; uses hmax8, hsum8, hsum8_epi32, pack_i32_to_i8, any_outlier_row,
// rows_tiled).
//
// Why: at batch 1 the int16 tile (quant_gemv_i16.h) is compute-bound on these formats: one
// thread of an AMD EPYC Zen 4 read Q4_K at 8-9 GB/s and Q6_K at ~10 GB/s (Q8_0 at 26), about
// half of what its memory gives a thread, and the Q4_K_M 1B model decoded at a third of llama.cpp's
// rate. Per block of 32 weights the int16 tile widens the weights to int16, multiplies, and does
// float work per block (a scale per 16 activations); here the weights stay bytes and a whole
// super-block of 256 is summed in integers, with one float product per super-block and row.
//
// Arithmetic: each row of x is rounded to int8 per 256 elements (a super-block: q = round(x 127 /
// max), one float scale dx per 256), with the sums of q per 16. A pair of weight bytes and
// activations gives an int16 by maddubs (unsigned weights 0..15 / 0..63 times signed q: at most
// 2 x 63 x 127, no saturation); vpdpwssd multiplies those by the sub-block's integer scale and
// adds them to int32 lanes. Q4_K: y = d dx sum_j sc_j (q_w . q_x)_j - dmin dx sum_j mn_j sum(q_x)_j;
// Q6_K (values q_w - 32 with int8 scales per 16): y = d dx (sum_i s_i (q_w . q_x)_i - 32 sum_i s_i
// sum(q_x)_i). The integer sums are exact; the result is the dequantized weights times the
// rounded x up to fp32 summation order (tests/model/activation_rounding.py models the rounding).
// A call whose rows include an outlier row (is_outlier_row: a few channels far above the rest,
// which per-256 rounding would flatten) computes in int16 instead.

#pragma once

// (not standalone: quant_gemv.h includes it after the pieces it uses)
namespace dp_quant {

// One super-block of a prepared row: the int8 values, their sums per 16, and the scale dx.
struct alignas(64) Q8KBlock {
  int8_t q[256];
  int16_t sums16[16];
  float dx;
  float pad[7];
};
static_assert(sizeof(Q8KBlock) == 320, "a prepared super-block is 5 cache lines");

inline bool q8k_format(int32_t format) { return format == DP_W_Q4_K || format == DP_W_Q6_K; }

// Rows of x up to which the int8 mode takes this path on the K-quant formats (quant_gemv_vnni.h's
// lanes from one more). One thread of an AMD EPYC Zen 4, against the lane groups (8 lanes up to 8
// rows, then 16): Q4_K 2.1x / 1.4x / 1.0x / 0.76x at 5 / 8 / 12 / 16 rows, Q6_K 3.4x / 1.6x / 1.2x / 0.87x.
constexpr int64_t Q8K_MAX_ROWS = 8;
inline int64_t q8k_row_bytes(int64_t K) { return (K / 256) * static_cast<int64_t>(sizeof(Q8KBlock)); }

// One row of x (K floats, a multiple of 256) rounded per super-block.
inline void quantize_row_q8k(const float* x, int64_t K, Q8KBlock* out) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t s = 0; s < K / 256; ++s) {
    const float* v = x + 256 * s;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 256; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(v + i)));
    const float amax = hmax8(m);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int i = 0; i < 256; i += 16) {
      const __m256i r0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), inv), ROUND));
      const __m256i r1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8), inv), ROUND));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out[s].q + i), pack_i32_to_i8(r0, r1));
      out[s].sums16[i / 16] = static_cast<int16_t>(hsum8_epi32(_mm256_add_epi32(r0, r1)));
    }
    out[s].dx = amax / 127.0f;
  }
}

// Whether the int8 mode takes this path for a call: a K-quant matrix and no outlier row in x.
inline bool q8k_applies(const WeightDesc& w, const float* x, int64_t M, int64_t ldx) {
  return q8k_format(w.format) && !any_outlier_row(x, M, ldx, w.K);
}

inline void prepare_q8k(const float* x, int64_t M, int64_t ldx, int64_t K, uint8_t* out) {
  for (int64_t m = 0; m < M; ++m)
    quantize_row_q8k(x + m * ldx, K, reinterpret_cast<Q8KBlock*>(out + m * q8k_row_bytes(K)));
}

// The int16 lanes all holding v.
inline __m256i broadcast16(int v) { return _mm256_set1_epi16(static_cast<int16_t>(v)); }

// Unsigned weights u (32 bytes) times 32 int8 activations, pairs scaled by the int16 lanes of sc
// and added to acc.
inline __m256i dot_scaled(__m256i acc, __m256i u, const int8_t* q, __m256i sc) {
  const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  return _mm256_dpwssd_epi32(acc, p, sc);
}

// out[m] = sum_k x[m, k] W[row, k] for MR prepared rows of x (Q8KBlock rows) and one Q4_K row.
template <int MR>
inline void tile_q8k_q4k(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
  __m256 acc[MR], macc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = macc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* g = row + s * Fmt<DP_W_Q4_K>::BYTES;
    for (int off = 0; off < Fmt<DP_W_Q4_K>::BYTES; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(g) + I16_PREFETCH_BYTES + off, _MM_HINT_T0);
    const float d = half_to_float(load_u16(g)), dmin = half_to_float(load_u16(g + 2));
    uint32_t u[3];
    std::memcpy(u, g + 4, 12);  // the 6-bit scales and mins (q4k_scale_min, with 32-bit masks)
    const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, mn_lo = u[1] & 0x3f3f3f3fu;
    const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const __m128i sc8 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(sc_hi), static_cast<int>(sc_lo)));
    const __m256i sc16 = _mm256_broadcastsi128_si256(sc8);  // sc_0..7 as int16, in both 128-bit lanes
    const __m256i mn32 = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(mn_hi), static_cast<int>(mn_lo)));
    __m256i wv[8], sc[8];
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 16 + 32 * p));
      wv[2 * p] = _mm256_and_si256(v, m4);
      wv[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    for (int j = 0; j < 8; ++j) sc[j] = _mm256_shuffle_epi8(sc16, broadcast16((2 * j) | ((2 * j + 1) << 8)));
    for (int m = 0; m < MR; ++m) {
      const Q8KBlock& xb = reinterpret_cast<const Q8KBlock*>(arows[m])[s];
      __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();  // two chains (integer: exact)
      for (int j = 0; j < 8; j += 2) {
        even = dot_scaled(even, wv[j], xb.q + 32 * j, sc[j]);
        odd = dot_scaled(odd, wv[j + 1], xb.q + 32 * (j + 1), sc[j + 1]);
      }
      const __m256i sumi = _mm256_add_epi32(even, odd);
      // sums of q per sub-block of 32 (pairs of the per-16 sums), times the mins
      const __m256i sums32 = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.sums16)),
                                               broadcast16(1));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * xb.dx), acc[m]);
      macc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(sums32, mn32)), _mm256_set1_ps(dmin * xb.dx),
                                macc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum8(acc[m]) - hsum8(macc[m]);
}

// The 8 sub-blocks of 32 of a Q6_K super-block as unsigned bytes 0..63 (values<DP_W_Q6_K> before
// its - 32): the low 4 bits from ql, bits 4-5 from qh, shifted into place as 16-bit lanes (the
// bits a shift carries in from the lane's other byte fall outside each byte's mask) and merged by
// one ternary logic operation. With this and q6k_scales_split, one row of x reads Q6_K at 28-32
// GB/s on one thread of a Zen 4 (1B head and down matrices), against 19-21 with each sub-block's
// bits shifted, masked and or-ed apart and its two scales broadcast from scalars.
inline void q6k_unsigned(const uint8_t* g, __m256i* wv) {
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + h * 64));
    const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + h * 64 + 32));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 128 + h * 32));
    const auto merge = [&](__m256i l, __m256i q) {  // (l & 15) | (q & 0x30)
      return _mm256_ternarylogic_epi32(_mm256_and_si256(l, m4), q, m2, 0xF8);
    };
    wv[4 * h] = merge(lo0, _mm256_slli_epi16(hi, 4));
    wv[4 * h + 1] = merge(lo1, _mm256_slli_epi16(hi, 2));
    wv[4 * h + 2] = merge(_mm256_srli_epi16(lo0, 4), hi);
    wv[4 * h + 3] = merge(_mm256_srli_epi16(lo1, 4), _mm256_srli_epi16(hi, 2));
  }
}

// The 16 scales of a Q6_K super-block (one per 16 weights) as int16, the even-numbered ones in the
// low 128 bits and the odd-numbered in the high: a byte shuffle then picks sub-block j's two (its
// halves') for the two 128-bit halves of its maddubs products.
inline __m256i q6k_scales_split(const int8_t* s8) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s8));
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
}

// out[m] for MR prepared rows of x and one Q6_K row.
template <int MR>
inline void tile_q8k_q6k(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* g = row + s * Fmt<DP_W_Q6_K>::BYTES;
    for (int off = 0; off < Fmt<DP_W_Q6_K>::BYTES; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(g) + I16_PREFETCH_BYTES + off, _MM_HINT_T0);
    const float d = half_to_float(load_u16(g + 208));
    const int8_t* s8 = reinterpret_cast<const int8_t*>(g + 192);
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s8)));
    const __m256i split = q6k_scales_split(s8);
    __m256i wv[8], sc[8];
    q6k_unsigned(g, wv);
    for (int j = 0; j < 8; ++j) sc[j] = _mm256_shuffle_epi8(split, broadcast16((2 * j) | ((2 * j + 1) << 8)));
    for (int m = 0; m < MR; ++m) {
      const Q8KBlock& xb = reinterpret_cast<const Q8KBlock*>(arows[m])[s];
      __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();  // two chains (integer: exact)
      for (int j = 0; j < 8; j += 2) {
        even = dot_scaled(even, wv[j], xb.q + 32 * j, sc[j]);
        odd = dot_scaled(odd, wv[j + 1], xb.q + 32 * (j + 1), sc[j + 1]);
      }
      __m256i sumi = _mm256_add_epi32(even, odd);
      // - 32 sum_i s_i sum(q_x)_i: the values' offset
      const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.sums16)), scales16);
      sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * xb.dx), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum8(acc[m]);
}

// Read as one stream at batch 1: alternating two halves of a chunk (rows_two_streams) made the
// Q6_K LM head of a 1B model 0.57x as fast on a Zen 4 (one thread, 7.3 against 12.9 GB/s).
template <int32_t F>
struct Q8KTile {
  static constexpr bool TWO_STREAMS = false;
  template <int MR>
  static void run(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
    if constexpr (F == DP_W_Q4_K) tile_q8k_q4k<MR>(row, arows, K, out);
    else tile_q8k_q6k<MR>(row, arows, K, out);
  }
};

// Rows [n0, n1) of W for the M prepared rows (Q4_K and Q6_K; false for another format).
template <int32_t F>
inline bool rows_q8k(const WeightDesc& w, const uint8_t* prepared, int64_t M, int64_t n0, int64_t n1, float* y,
                     int64_t ldy) {
  if constexpr (F == DP_W_Q4_K || F == DP_W_Q6_K) {
    rows_tiled<Q8KTile<F>>(w, prepared, q8k_row_bytes(w.K), M, n0, n1, y, ldy);
    return true;
  } else {
    return false;
  }
}

}  // namespace dp_quant
