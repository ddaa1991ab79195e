// AVX2 GEMV rows for ONE row of fp32 x against bf16 W (compiled only into the avx2 variant):
// the weights are widened without shuffles. A 256-bit load holds 16 bf16 weights as 8 dwords
// (w[2d] in the low half, w[2d + 1] in the high half); `dword << 16` is w[2d] as fp32 and
// `dword & 0xffff0000` is w[2d + 1], so each 16 weights cost one load, one shift and one and,
// where the generic vf path (vload of bf16) spends two loads, two vpmovzxwd (one shuffle port on
// Intel) and two shifts. x is split once per call into the same even / odd order (split_pairs).
//
// Bitwise the same as tile_f32<1, NR> (cpu_kernels.cpp): every element position j of a block of
// 16 has its own lane and accumulates x[16 i + j] * w[16 i + j] with one FMA per block in k order,
// exactly as the vf path's lane j does; before the reduction the lanes are put back in the vf
// order (lo = elements 0-7, hi = 8-15) and reduced by the same vsum. So a lone row still gets
// the outputs it gets inside a batch (tests/model/test_batch_invariance.py).

#pragma once

#include "cpu_simd.h"

#if defined(DP_ISA_AVX2)

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace dp {

// x [K] fp32 -> xs [K rounded up to 16]: per block of 16, the 8 even elements, then the 8 odd
// ones; zeros past K.
inline void split_pairs(const float* x, int64_t K, float* xs) {
  const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t k = 0; k < K; k += 16) {
    const vf v = vload(x + k, K - k);
    const __m256 a = _mm256_permutevar8x32_ps(v.lo, idx), b = _mm256_permutevar8x32_ps(v.hi, idx);
    _mm256_storeu_ps(xs + k, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(xs + k + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
}

// One block of 16 weights of each of NR rows (at p[r]) against the split x block xs.
template <int NR>
__attribute__((always_inline)) inline void pairs_block(const float* xs, const bf16* const* p, __m256* ae, __m256* ao) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 xe = _mm256_loadu_ps(xs), xo = _mm256_loadu_ps(xs + 8);
  for (int r = 0; r < NR; ++r) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[r]));
    ae[r] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), ae[r]);
    ao[r] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(wv, high)), ao[r]);
  }
}

// W rows [n0, n0 + NR) (rows past N clamped to N - 1 and not stored) against the split row xs,
// K weights per row, ldw apart; `prefetch_bytes` ahead in each row stream, once per cache line.
template <int NR, class EP>
inline void row_tile_pairs(const float* xs, int64_t K, const bf16* w, int64_t ldw, int64_t n0, int64_t N,
                           int64_t prefetch_bytes, const EP& ep) {
  const bf16* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * ldw;
  __m256 ae[NR], ao[NR];
  for (int r = 0; r < NR; ++r) ae[r] = ao[r] = _mm256_setzero_ps();
  const bf16* p[NR];
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int r = 0; r < NR; ++r) {
      p[r] = rows[r] + k;
      if (prefetch_bytes) _mm_prefetch(reinterpret_cast<const char*>(p[r]) + prefetch_bytes, DP_PREFETCH_HINT);
    }
    pairs_block<NR>(xs + k, p, ae, ao);
    for (int r = 0; r < NR; ++r) p[r] += 16;
    pairs_block<NR>(xs + k + 16, p, ae, ao);
  }
  if (k + 16 <= K) {
    for (int r = 0; r < NR; ++r) p[r] = rows[r] + k;
    pairs_block<NR>(xs + k, p, ae, ao);
    k += 16;
  }
  if (k < K) {
    alignas(32) bf16 tail[NR][16];
    for (int r = 0; r < NR; ++r) {
      const int64_t n = std::min<int64_t>(16, K - k);
      std::memset(tail[r], 0, sizeof(tail[r]));
      std::memcpy(tail[r], rows[r] + k, static_cast<size_t>(n) * sizeof(bf16));
      p[r] = tail[r];
    }
    pairs_block<NR>(xs + k, p, ae, ao);
  }
  for (int r = 0; r < NR; ++r) {
    if (n0 + r >= N) continue;
    // lanes back in vf order: lo = elements 0-7 (e0 o0 e1 o1 e2 o2 e3 o3), hi = 8-15
    const __m256 ul = _mm256_unpacklo_ps(ae[r], ao[r]), uh = _mm256_unpackhi_ps(ae[r], ao[r]);
    ep.store(0, n0 + r, vsum(vf{_mm256_permute2f128_ps(ul, uh, 0x20), _mm256_permute2f128_ps(ul, uh, 0x31)}));
  }
}

}  // namespace dp

#endif  // DP_ISA_AVX2
