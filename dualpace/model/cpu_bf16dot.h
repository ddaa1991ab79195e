// AVX512_BF16 specialisations of the CPU kernels (compiled only into the avx512_bf16 variant):
// bf16 x bf16 GEMV tiles with vdpbf16ps, and the pieces of decode attention that keep bf16 K/V
// and probabilities in pairs for vdpbf16ps (scores with tokens in lanes, p @ V over token pairs).
// Everything else, and every other variant, uses the vf-based code in cpu_kernels.cpp and
// cpu_attention.h.

#pragma once

#include "cpu_simd.h"

#if defined(DP_ISA_BF16DOT)

#include <immintrin.h>

#include <algorithm>

namespace dp {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Rows [n0, n0 + NR) of W (rows past N are clamped to N - 1 and not stored) against MR rows of x.
template <int MR, int NR, class EP>
inline void linear_tile_dot(const bf16* x, int64_t ldx, int64_t m0, int64_t K, const bf16* w, int64_t ldw, int64_t n0,
                            int64_t N, const EP& ep) {
  const bf16* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * ldw;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r)  // software prefetch DP_PREFETCH_BYTES ahead in each row stream
      if (DP_PREFETCH_BYTES) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + DP_PREFETCH_BYTES, DP_PREFETCH_HINT);
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

// p @ V over one chunk of n <= 16 tokens (rows `stride` elements apart), query heads
// [g0, g0 + NG), accumulated into acc (float32 [group, D], in the kernel's lane order):
// token pairs are interleaved so one dpbf16 multiplies two tokens' values by their two
// bf16 probabilities; the accumulator lanes are then permuted within 128-bit lanes (undone
// by unpermute_pairs at the end).
template <int ND, int NG>
__attribute__((always_inline)) inline void pv_chunk_pairs(const bf16* v, int64_t stride, int64_t n,
                                                          const bf16* probs /* [group, ld] */, int64_t ld, int64_t g0,
                                                          float* acc_mem) {
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

// accumulator lane -> element of the head (the layout pv_chunk_pairs leaves)
inline void unpermute_pairs(const float* acc, int64_t D, float* out) {
  for (int64_t j = 0; j < D / 32; ++j)
    for (int half = 0; half < 2; ++half)
      for (int lane = 0; lane < 4; ++lane)
        for (int e = 0; e < 4; ++e) out[32 * j + lane * 8 + half * 4 + e] = acc[(2 * j + half) * 16 + lane * 4 + e];
}

// Stores probabilities (bf16: rounded to nearest even by vcvtneps2bf16) and returns the stored values.
inline __m512 store_probs(bf16* dst, __m512 p) {
  const __m256bh converted = _mm512_cvtneps_pbh(p);
  __m256i bits;
  std::memcpy(&bits, &converted, sizeof(bits));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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

}  // namespace dp

#endif  // DP_ISA_BF16DOT
