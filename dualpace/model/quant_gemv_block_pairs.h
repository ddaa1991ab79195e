// The int8 mode's rows for Q8_0 and Q4_0 up to PAIRS_MAX_ROWS rows of x, in builds with AVX-512
// VNNI: the decode batches 1-8, where the lane groups of quant_gemv_vnni.h have too few rows to
// fill their lanes. Included by quant_gemv.h after quant_gemv_vnni.h (namespace dp_quant; uses
// hsum8, round16_i8, any_outlier_row).
//
// Why: these formats carry a float scale per block of 32 weights, so a product that keeps the
// weights in the vector lanes pays float work (convert, scale, FMA) per block and row; with one
// block per 8-lane vector that float work bounded the rows (quant_gemv_vnni.h). Here two 8-lane
// vectors hold two blocks, A and B, each lane summing 8 products of one half (16 weights) of one
// block: lanes [A0 A0 A1 A1 B0 B0 B1 B1] (A0: A's first 16). The first vector holds weights 0-7
// of each half, the second 8-15, so two vpdpbusd and one convert, scale product and FMA cover the
// 64 weights of a pair and a row, and each weight vector, built once per W row, serves every row
// of x in the call.
//
// Arithmetic: each row of x is rounded to int8 per 16 elements (q = round(x 127 / max), one scale
// dx per 16, as the lane groups of quant_gemv_vnni.h round: llama.cpp's q8_0 activations have one
// per 32; per 32 here flipped the default model's chat answer, a near tie, where per 16 kept it),
// in the weight vectors' order. Q8_0: the activations are stored as q + 128 (vpdpbusd's unsigned
// operand) and the weights' bytes are its signed operand, so a lane sums dot(q, w) + 128 sum(w);
// each weight vector's lanes start at -128 sum(w) (a vpdpbusd of 128s with the weights, once per W
// row and pair). Q4_0: the nibbles n = w + 8 are the unsigned operand and the activations, stored
// as q, the signed one, so a lane sums dot(q, w) + 8 sum(q); its lanes start at -8 sum(q), stored
// per lane with the row of x, so the W row's work is only unpacking its nibbles (Q8_0's form for
// Q4_0, the nibbles - 8 and the starts per W row and pair, ran 0.75-0.79x of this at 1 row of x,
// 0.84-0.97x at 4 and 0.91-1.0x at 8: one thread of a Zen 4, the 1B's and 0.5B's Q4_0 matrices;
// Q8_0 would save only one operation a W row and pair, as its values need a xor). Either way the
// integer sums are dot(q, w) exactly, and per pair and row acc += (dw dx) cvt(sum) lane-wise. The
// result is the dequantized weights times the rounded x up to fp32 summation order
// (tests/model/activation_rounding.py models the rounding). A call whose rows include an outlier
// row (is_outlier_row) computes in int16 instead.

#pragma once

// (not standalone: quant_gemv.h includes it after the pieces it uses)
namespace dp_quant {

// One pair of blocks (A, B) of a prepared row: q (Q4_0) or q + 128 (Q8_0) in the weight vectors'
// order (A 0-7, A 16-23, B 0-7, B 16-23, then A 8-15, A 24-31, B 8-15, B 24-31) and the scales dx
// of A0, A1, B0, B1 (the halves of 16). Q4_0's pairs are followed by each lane's start, -8 sum(q)
// of its 8 elements (PairStarts).
struct PairBlock {
  uint8_t q[64];
  float dx[4];
};
static_assert(sizeof(PairBlock) == 80, "a prepared pair is 80 bytes");
struct PairStarts {
  int32_t start[8];
};
inline int64_t pair_bytes(int32_t format) {
  return static_cast<int64_t>(sizeof(PairBlock)) + (format == DP_W_Q4_0 ? static_cast<int64_t>(sizeof(PairStarts)) : 0);
}

inline bool pairs_format(int32_t format) { return format == DP_W_Q8_0 || format == DP_W_Q4_0; }

// Rows of x up to which the int8 mode takes this path on Q8_0 and Q4_0 (quant_gemv_vnni.h's lanes
// from one more).
constexpr int64_t PAIRS_MAX_ROWS = 8;
inline int64_t pairs_row_bytes(int64_t K, int32_t format) { return (K / 32 + 1) / 2 * pair_bytes(format); }

// 16 floats of x rounded to int8 (plus 128 where offset): bytes 0-7 to lo, 8-15 to hi; returns dx.
inline float quantize_half16(const float* v, bool offset, uint8_t* lo, uint8_t* hi) {
  __m128i q8;
  int32_t sum_q;
  const float dx = round16_i8(v, &q8, &sum_q);
  const __m128i p8 = offset ? _mm_xor_si128(q8, _mm_set1_epi8(static_cast<char>(0x80))) : q8;
  _mm_storel_epi64(reinterpret_cast<__m128i*>(lo), p8);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(hi), _mm_unpackhi_epi64(p8, p8));
  return dx;
}

// One row of x (K floats, a multiple of 32) into pairs for a weight format; an odd last block pairs
// with q = 0.
inline void quantize_row_pairs(const float* x, int64_t K, int32_t format, uint8_t* out) {
  const int64_t blocks = K / 32;
  const bool offset = format == DP_W_Q8_0;
  for (int64_t p = 0; p < (blocks + 1) / 2; ++p) {
    PairBlock& pb = *reinterpret_cast<PairBlock*>(out + p * pair_bytes(format));
    for (int blk = 0; blk < 2; ++blk)
      for (int half = 0; half < 2; ++half) {
        const int unit = 2 * blk + half;  // A0, A1, B0, B1
        uint8_t* lo = pb.q + 8 * unit;
        if (2 * p + blk < blocks) {
          pb.dx[unit] = quantize_half16(x + 32 * (2 * p + blk) + 16 * half, offset, lo, lo + 32);
        } else {
          pb.dx[unit] = 0.0f;
          std::memset(lo, offset ? 0x80 : 0, 8);
          std::memset(lo + 32, offset ? 0x80 : 0, 8);
        }
      }
    if (!offset) {  // -8 sum(q) of each lane's 8 elements (4 in each of the two vectors)
      const __m256i eights = _mm256_set1_epi8(8);
      const __m256i qlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb.q));
      const __m256i qhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb.q + 32));
      const __m256i sums = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), eights, qlo), eights, qhi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<PairStarts*>(&pb + 1)->start),
                          _mm256_sub_epi32(_mm256_setzero_si256(), sums));
    }
  }
}

// Whether the int8 mode takes this path for a call: Q8_0 or Q4_0 and no outlier row in x.
inline bool pairs_apply(const WeightDesc& w, const float* x, int64_t M, int64_t ldx) {
  return pairs_format(w.format) && !any_outlier_row(x, M, ldx, w.K);
}

inline void prepare_pairs(const WeightDesc& w, const float* x, int64_t M, int64_t ldx, uint8_t* out) {
  for (int64_t m = 0; m < M; ++m)
    quantize_row_pairs(x + m * ldx, w.K, w.format, out + m * pairs_row_bytes(w.K, w.format));
}

// The weight vectors of blocks a and b (b null: zeros) of one W row: lo holds weights 0-7 of each
// half of 16 (A 0-7, A 16-23, B 0-7, B 16-23), hi weights 8-15, as signed bytes (Q8_0, with start
// -128 sum(w) per lane) or as the nibbles w + 8 (Q4_0, start unused); dw the blocks' scales, A's in
// lanes 0-3, B's in 4-7.
template <int32_t F>
inline void pair_weights(const uint8_t* a, const uint8_t* b, __m256i* lo, __m256i* hi, __m256i* start, __m256* dw) {
  const uint16_t hb = b ? load_u16(b) : 0;
  const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u16(a) | (static_cast<uint32_t>(hb) << 16))));
  *dw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d), _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  const auto pair16 = [&](int off) {  // 16 bytes of A in the low 128 bits, of B in the high
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off));
    return b ? _mm256_inserti128_si256(_mm256_castsi128_si256(va),
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off)), 1)
             : _mm256_zextsi128_si256(va);
  };
  __m256i first, second;  // elements 0-15 and 16-31 of each block
  if constexpr (F == DP_W_Q8_0) {
    first = pair16(2);
    second = pair16(18);
  } else {  // Q4_0: byte i holds element i (low nibble) and i + 16 (high); b null: B's are zeros
    const __m256i v = pair16(2), m4 = _mm256_set1_epi8(15);
    first = _mm256_and_si256(v, m4);
    second = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
  *lo = _mm256_unpacklo_epi64(first, second);
  *hi = _mm256_unpackhi_epi64(first, second);
  if constexpr (F == DP_W_Q8_0) {
    const __m256i k128 = _mm256_set1_epi8(static_cast<char>(0x80));
    *start = _mm256_sub_epi32(_mm256_setzero_si256(),
                              _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), k128, *lo), k128, *hi));
  }
}

// out[m][r] = sum_k x[m, k] W[row r, k] for MR prepared rows of x and NR Q8_0 / Q4_0 rows of W:
// each prepared pair, loaded once, serves the NR rows of W. Both lines a pair may span are
// prefetched ahead_bytes ahead: the next tile's row for two W rows (a tile ahead, as
// quant_gemv_vnni.h's tile_vnni: 4096 bytes ahead within the row left the second row of each tile
// cold; one thread of a Zen 4, 1B Q8_0 gate/up and down at 5-8 rows of x: 1.05-1.09x),
// I16_PREFETCH_BYTES for one (1.02-1.07x at 1-2 rows from the second line).
template <int32_t F, int MR, int NR>
inline void tile_pairs(const uint8_t* const* wrows, const uint8_t* const* arows, int64_t K, float (*out)[NR],
                       int64_t ahead_bytes) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t blocks = K / 32;
  const __m256i spread = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);  // dx of A0, A1, B0, B1 to their lanes
  for (int64_t p = 0; p < (blocks + 1) / 2; ++p) {
    __m256i lo[NR], hi[NR], start[NR];
    __m256 dw[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* a = wrows[r] + 2 * p * Fmt<F>::BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(a) + ahead_bytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a) + ahead_bytes + 64, _MM_HINT_T0);
      pair_weights<F>(a, 2 * p + 1 < blocks ? a + Fmt<F>::BYTES : nullptr, &lo[r], &hi[r], &start[r], &dw[r]);
    }
    for (int m = 0; m < MR; ++m) {
      const PairBlock& xb = *reinterpret_cast<const PairBlock*>(arows[m] + p * pair_bytes(F));
      const __m256 dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xb.dx)), spread);
      const __m256i qlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
      const __m256i qhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q + 32));
      __m256i xstart = _mm256_setzero_si256();  // Q4_0: the row's starts, -8 sum(q) per lane
      if constexpr (F == DP_W_Q4_0)
        xstart = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const PairStarts*>(&xb + 1)));
      for (int r = 0; r < NR; ++r) {
        const __m256i s = F == DP_W_Q8_0 ? _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start[r], qlo, lo[r]), qhi, hi[r])
                                         : _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(xstart, lo[r], qlo), hi[r], qhi);
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw[r], dx), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = hsum8(acc[m][r]);
}

// Rows [n0, n1) of W for the M prepared rows (up to PAIRS_MAX_ROWS): each W row read once. From 5
// rows of x a tile takes two W rows. One thread of an AMD EPYC Zen 4, 1B gate/up and down
// matrices, two W rows against one: 1.08-1.16x at 8 rows of x, 1.0x at 4, 0.75-0.8x at 2 (two
// weight streams at once read slowly there, as the int16 tile's did at batch 1).
template <int32_t F>
inline bool rows_pairs(const WeightDesc& w, const uint8_t* prepared, int64_t M, int64_t n0, int64_t n1, float* y,
                       int64_t ldy) {
  if constexpr (F == DP_W_Q8_0 || F == DP_W_Q4_0) {
    const int64_t stride = pairs_row_bytes(w.K, F);
    const uint8_t* arows[PAIRS_MAX_ROWS];
    for (int m = 0; m < PAIRS_MAX_ROWS; ++m) arows[m] = prepared + std::min<int64_t>(m, M - 1) * stride;
    const auto run = [&](auto mr, auto nr) {
      constexpr int MR = decltype(mr)::value, NR = decltype(nr)::value;
      float out[MR][NR];
      for (int64_t n = n0; n < n1; n += NR) {
        const uint8_t* wrows[NR];
        for (int r = 0; r < NR; ++r)  // past the last: any row (outputs dropped)
          wrows[r] = static_cast<const uint8_t*>(w.data) + std::min(n + r, n1 - 1) * w.row_bytes;
        tile_pairs<F, MR, NR>(wrows, arows, w.K, out, NR == 1 ? I16_PREFETCH_BYTES : NR * w.row_bytes);
        for (int m = 0; m < MR; ++m)
          for (int r = 0; r < NR && n + r < n1; ++r) y[m * ldy + (n - n0 + r)] = out[m][r];
      }
    };
    switch (M) {
      case 1: run(Rows<1>{}, Rows<1>{}); break;
      case 2: run(Rows<2>{}, Rows<1>{}); break;
      case 3: run(Rows<3>{}, Rows<1>{}); break;
      case 4: run(Rows<4>{}, Rows<1>{}); break;
      case 5: run(Rows<5>{}, Rows<2>{}); break;
      case 6: run(Rows<6>{}, Rows<2>{}); break;
      case 7: run(Rows<7>{}, Rows<2>{}); break;
      default: run(Rows<8>{}, Rows<2>{}); break;
    }
    return true;
  } else {
    return false;
  }
}

}  // namespace dp_quant
