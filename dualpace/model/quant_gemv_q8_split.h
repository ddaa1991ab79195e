// Q8_0 weights in the opt-in `int16-split` activation mode: int8 x int8 products on 32 lanes
// (_mm256_maddubs_epi16) instead of the weights widened to int16. AVX2 only; included by
// quant_gemv.h after quant_gemv_i16.h (namespace dp_quant; uses Fmt, scales4, hsum8, hmax8,
// hsum8_epi32, i16_quads, Rows, rows_tiled).
//
// Why it exists: quant_gemv_i16.h widens every int8 weight (two cvtepi8_epi16 per 32 weights),
// and at batch 1 nothing amortises that. maddubs multiplies 32 byte pairs at once, but its
// activation side must fit in a byte, and llama.cpp's int8 activations (1/127 of a block's max)
// changed greedy output here. So each activation is rounded to a ~14-bit integer and split in
// two bytes. Why it is not the default: per 32 weights and activation row it takes two maddubs
// and two madd (the int16 kernel: two madd), which outweighs the widening it saves at batch 1
// and loses from batch 2 (measured on an AVX2 Zen 3, one thread, interleaved). With
// VNNI (vpdpbusd) the two madd would go and the split could pay; not built here.
//
// Arithmetic. Per 16 elements of a block (A: elements 0-15, B: 16-31, the two 128-bit lanes of
// maddubs' result) q = round(x / dx), dx = max|x| / SPLIT_QMAX, split as q = 128 hi + lo with
// hi, lo in -64..63 (signed digits: hi = (q + 64) >> 7). The weights go to maddubs' unsigned side
// as u = w + 128 (one XOR with 0x80; 0..255 for any int8 w), the activation bytes to the signed
// side. No saturation: a pair sum is at most 2 x 255 x 64 = 32640 < 32767. Then
//   madd(maddubs(u, hi), 128) + madd(maddubs(u, lo), 1) = sum u q = sum w q + 128 sum q,
// and 128 sum q (an integer per half, made with the activations) is subtracted after the
// horizontal add, so the integer result is exactly sum w q: the output is the dequantized
// weights times the rounded x, up to fp32 summation order. |x - dx q| <= dx / 2 = 6.2e-5 of the
// half's max (int16: 1.5e-5; int8 per 32: 3.9e-3). Half sums: 16 x 255 x 8256 < 2^31.
//
// Prepared activations, per row of x (split_row_bytes): quads of 4 blocks, each SPLIT_QUAD_BYTES:
// per block hi[32] then lo[32], then [dx_A of blocks 0..3 | dx_B ...] (8 floats) and
// [128 sum q over A of blocks 0..3 | over B] (8 int32); all zero for padded blocks.

#pragma once

// (not standalone: quant_gemv.h includes it after the pieces it uses)
namespace dp_quant {

constexpr int64_t SPLIT_QMAX = 8127;  // = 128 x 63 + 63: the largest |q| whose digits fit -64..63
constexpr int64_t SPLIT_QUAD_BYTES = 4 * 64 + 8 * 4 + 8 * 4;

inline int64_t split_row_bytes(int64_t K) { return i16_quads(K) * SPLIT_QUAD_BYTES; }

// 8 int32 of the same 128-bit lane pattern into bytes: [a0-3 b0-3 c0-3 d0-3 | a4-7 ...] -> order
inline __m256i pack_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A block of 32 floats of x -> hi[32], lo[32] at out, its scales and offset terms.
inline void quantize_block_split(const float* x, uint8_t* out, float* dx_a, float* dx_b, int32_t* off_a,
                                 int32_t* off_b) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const float max_a = hmax8(_mm256_max_ps(_mm256_andnot_ps(sign_bit, v[0]), _mm256_andnot_ps(sign_bit, v[1])));
  const float max_b = hmax8(_mm256_max_ps(_mm256_andnot_ps(sign_bit, v[2]), _mm256_andnot_ps(sign_bit, v[3])));
  const float qmax = static_cast<float>(SPLIT_QMAX);
  const __m256 inv_a = _mm256_set1_ps(max_a > 0.0f ? qmax / max_a : 0.0f);
  const __m256 inv_b = _mm256_set1_ps(max_b > 0.0f ? qmax / max_b : 0.0f);
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i q[4], hi[4], lo[4];
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], i < 2 ? inv_a : inv_b), ROUND));
    hi[i] = _mm256_srai_epi32(_mm256_add_epi32(q[i], _mm256_set1_epi32(64)), 7);
    lo[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(hi[i], 7));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), pack_bytes(hi[0], hi[1], hi[2], hi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), pack_bytes(lo[0], lo[1], lo[2], lo[3]));
  *dx_a = max_a / qmax;
  *dx_b = max_b / qmax;
  *off_a = 128 * hsum8_epi32(_mm256_add_epi32(q[0], q[1]));
  *off_b = 128 * hsum8_epi32(_mm256_add_epi32(q[2], q[3]));
}

// One row of x (K floats, a multiple of 32) into the layout above.
inline void quantize_row_split(const float* x, int64_t K, uint8_t* out) {
  std::memset(out, 0, static_cast<size_t>(split_row_bytes(K)));
  for (int64_t b = 0; b < K / 32; ++b) {
    uint8_t* quad = out + (b / 4) * SPLIT_QUAD_BYTES;
    float* dx = reinterpret_cast<float*>(quad + 4 * 64);
    int32_t* off = reinterpret_cast<int32_t*>(quad + 4 * 64 + 8 * 4);
    const int i = static_cast<int>(b % 4);
    quantize_block_split(x + 32 * b, quad + 64 * i, &dx[i], &dx[4 + i], &off[i], &off[4 + i]);
  }
}

// out[m] = sum_k x[m, k] W[row, k] for MR prepared activation rows, W one Q8_0 row.
template <int MR>
inline void tile_q8_split(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
  using Spec = Fmt<DP_W_Q8_0>;
  const int64_t nb = K / 32, nq = i16_quads(K);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i x128 = _mm256_set1_epi16(128), x1 = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t qd = 0; qd < nq; ++qd) {
    const int64_t b0 = 4 * qd;
    const int count = static_cast<int>(std::min<int64_t>(4, nb - b0));
    _mm_prefetch(reinterpret_cast<const char*>(row + b0 * Spec::BYTES) + 1024, _MM_HINT_T0);
    __m256i u[4];
    for (int i = 0; i < 4; ++i) {
      u[i] = i < count ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                              row + (b0 + i) * Spec::BYTES + 2)), flip)
                       : _mm256_setzero_si256();
    }
    const __m256 ws = scales4<DP_W_Q8_0>(row, b0, count);
    const __m256 dw = _mm256_permute2f128_ps(ws, ws, 0x00);  // [dw_0..3 | dw_0..3]
    for (int m = 0; m < MR; ++m) {
      const uint8_t* a = arows[m] + qd * SPLIT_QUAD_BYTES;
      __m256i s[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 64 * i));
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 64 * i + 32));
        s[i] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u[i], hi), x128),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], lo), x1));
      }
      // lanes [sum u q of block i over elements 0-15 (i = 0..3) | over 16-31], less 128 sum q
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
      const __m256i off = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 4 * 64 + 8 * 4));
      const __m256 dx = _mm256_loadu_ps(reinterpret_cast<const float*>(a + 4 * 64));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(h, off)), _mm256_mul_ps(dw, dx), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum8(acc[m]);
}

struct SplitTile {
  template <int MR>
  static void run(const uint8_t* row, const uint8_t* const* arows, int64_t K, float* out) {
    tile_q8_split<MR>(row, arows, K, out);
  }
};

inline void rows_q8_split(const WeightDesc& w, const uint8_t* act, int64_t M, int64_t n0, int64_t n1, float* y,
                          int64_t ldy) {
  rows_tiled<SplitTile>(w, act, split_row_bytes(w.K), M, n0, n1, y, ldy);
}

}  // namespace dp_quant
