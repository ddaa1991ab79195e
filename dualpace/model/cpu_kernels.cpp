// CPU kernels for decode, one source for every instruction set (see KERNELS.md).
//
// Compiled by dualpace/model/cpu_kernels_build.py once per variant (avx512_bf16, avx512, avx2,
// generic) and called through ctypes. Threads come from the OpenMP runtime torch itself loaded,
// so these kernels and torch's share one pool and one thread count (torch.set_num_threads).
//
// Element types: "T" is float (fp32) or uint16_t holding bfloat16 bits: the activations' type.
// Weights are described by a WeightDesc (kernel_weights.h) of any format. All arithmetic is in
// float32; bf16 results are rounded to nearest even.
//
//   linear_any       y = x W^T (+ bias) (+ residual), small M (decode GEMV): streams W once per
//                    call; F32 / BF16 weights here (vdpbf16ps tiles on avx512_bf16 for bf16 x
//                    bf16, fp32 FMA on widened weights elsewhere), other formats via quant_gemv.h.
//   rms_norm         RMSNorm (rounding like the reference: normalize, round, multiply by weight).
//   rotary           in-place rotate-half RoPE over the q and k heads of a fused qkv row.
//   silu_mul         silu(gate) * up over a fused [gate | up] row.
//   first_max_rows   each row's argmax, the lowest column among ties (greedy sampling).
//   kv_write         scatter a step's k and v rows into their cache slots.
//   decode attention cpu_attention.h.
//   decode_layer     a whole decoder layer of a decode step, all layers in one call.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention.h"
#include "cpu_bf16dot.h"
#include "cpu_pairs_avx2.h"
#include "cpu_simd.h"
#include "cpu_step_stages.h"
#include "kernel_weights.h"

#if __has_include("quant_gemv.h")
#include "quant_gemv.h"
#define DP_HAS_QUANT 1
#else
#define DP_HAS_QUANT 0
#endif

using namespace dp;

namespace {

// ---------------------------------------------------------------------------------------------
// linear
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

// Calls f(integral_constant<int, M>) for M in 1..8.
template <typename F>
inline void with_rows(int64_t M, F&& f) {
  using std::integral_constant;
  switch (M) {
    case 1: f(integral_constant<int, 1>{}); break;
    case 2: f(integral_constant<int, 2>{}); break;
    case 3: f(integral_constant<int, 3>{}); break;
    case 4: f(integral_constant<int, 4>{}); break;
    case 5: f(integral_constant<int, 5>{}); break;
    case 6: f(integral_constant<int, 6>{}); break;
    case 7: f(integral_constant<int, 7>{}); break;
    case 8: f(integral_constant<int, 8>{}); break;
    default: break;
  }
}

// MR rows of fp32 x (from row m0, ldx apart) against W rows [n0, n0 + NR) of element type WT
// (ldw elements apart; rows past N are clamped to N - 1 and not stored). The weights are widened
// to fp32 in registers. Every output is one accumulator over k in steps of 16 whatever MR and NR
// are, so a row of x gets bitwise the same outputs alone as in any batch (batch invariance:
// tests/model/test_batch_invariance.py); a lone row gets its second dependency chain from a second
// W row (rows_f32), not from splitting k.
template <int MR, int NR, typename WT, class EP>
inline void tile_f32(const float* x, int64_t ldx, int64_t m0, int64_t K, const WT* w, int64_t ldw, int64_t n0,
                     int64_t N, const EP& ep) {
  const WT* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * ldw;
  vf acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = vzero();
  int64_t k = 0;
  for (; k < K; k += 16) {
    const int64_t n = K - k;
    vf wv[NR];
    for (int r = 0; r < NR; ++r) {
      if (DP_PREFETCH_BYTES) prefetch(reinterpret_cast<const char*>(rows[r] + k) + DP_PREFETCH_BYTES);
      wv[r] = vload(rows[r] + k, n);
    }
    for (int m = 0; m < MR; ++m) {
      const vf xv = vload(x + (m0 + m) * ldx + k, n);
      for (int r = 0; r < NR; ++r) acc[m][r] = vfma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      if (n0 + r < N) ep.store(m0 + m, n0 + r, vsum(acc[m][r]));
}

// Runs fn(n_begin, n_end) over chunks of W rows, in parallel for products large enough.
// Chunks are handed out dynamically, so that a thread slowed by another tenant hands work to the
// other. Up to SMALL_M rows of x stream W: about 2 chunks per thread, because every chunk
// restarts a weight stream (the first 2 KB of it not prefetched, the hardware prefetchers
// retraining); with 8 per thread the batch-1 step streamed ~10-20% slower on Zen 4.
// Larger M is compute-bound: about 8 per thread, at most 64 tiles of 4 rows.
constexpr int64_t SMALL_M = 8;
constexpr int64_t NR = 4;
// W rows per chunk for M rows of x against N rows of W with `threads` threads.
inline int64_t chunk_rows(int64_t M, int64_t N, int threads) {
  const int64_t num_tiles = (N + NR - 1) / NR;
  int64_t tiles_per_chunk;
  if (M <= SMALL_M) {
    tiles_per_chunk = std::max<int64_t>(1, num_tiles / (2 * threads));
  } else {
    tiles_per_chunk = std::min<int64_t>(64, std::max<int64_t>(1, num_tiles / (8 * threads)));
  }
  return tiles_per_chunk * NR;
}

// W rows per chunk on AMX tiles: chunk_rows rounded up to whole 32-row blocks.
inline int64_t amx_chunk_rows(int64_t M, int64_t N, int threads) {
  return (chunk_rows(M, N, threads) + 31) / 32 * 32;
}

template <typename Fn>
void for_row_chunks(int64_t M, int64_t N, int64_t K, Fn&& fn, bool amx = false) {
  const int threads = omp_get_max_threads();
  const int64_t rows_per_chunk = amx ? amx_chunk_rows(M, N, threads) : chunk_rows(M, N, threads);
  const int64_t num_chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  // Small products stay on the calling thread: a parallel region costs a few microseconds, and
  // when several threads of one process run kernels at once (a server beside its client) their
  // OpenMP teams would compete for the same cores.
#pragma omp parallel for schedule(dynamic, 1) if (M * N * K >= PARALLEL_MIN_MACS)
  for (int64_t c = 0; c < num_chunks; ++c) fn(c * rows_per_chunk, std::min(N, (c + 1) * rows_per_chunk));
}

// Walks W rows [n_begin, n_end) against all M rows of x as tile(MR, NR, m0, n0) calls
// (integral_constant MR, NR): one W row at a time for up to SMALL_M rows of x (each thread reads
// one sequential stream, which the prefetchers follow best), 4 x NR tiles beyond.
template <typename Tile>
void walk_tiles(int64_t M, int64_t n_begin, int64_t n_end, Tile&& tile) {
  using std::integral_constant;
  if (M <= SMALL_M) {
    with_rows(M, [&](auto mr) {
      for (int64_t n = n_begin; n < n_end; ++n) tile(mr, integral_constant<int, 1>{}, 0, n);
    });
    return;
  }
  for (int64_t n0 = n_begin; n0 < n_end; n0 += NR) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) tile(integral_constant<int, 4>{}, integral_constant<int, NR>{}, m0, n0);
    with_rows(M - m0, [&](auto mr) { tile(mr, integral_constant<int, NR>{}, m0, n0); });
  }
}

// One row of x against W rows of fewer bytes than this: one W row per tile, so that each thread reads
// its W rows as one sequential stream; longer rows take two (or, on the vdpbf16ps GEMV, 8) W rows per
// tile. Two threads of a Zen 4 against those tiles, one row of x, W rows 576 / 896 / 2048 / 8192 wide:
// bf16 W on the avx2 and avx512 variants 1.46-1.67x / 1.40-1.49x / 1.18-1.20x / (kept) 0.97-1.01x,
// fp32 W 1.25-1.35x / 1.25-1.31x / (kept) 0.97-1.03x, the vdpbf16ps GEMV (rows_bf16dot) -
// / 1.31-1.38x / 1.03-1.09x / (kept) 0.89-1.00x.
constexpr int64_t ONE_W_ROW_MAX_ROW_BYTES = 8192;

// W rows [n_begin, n_end) of an F32 / BF16 matrix against all M rows of fp32 x.
template <typename WT, class EP>
void rows_f32(const float* x, int64_t M, int64_t ldx, int64_t K, const WT* w, int64_t ldw, int64_t n_begin,
              int64_t n_end, const EP& ep) {
  if (M == 1) {  // long rows two at a time: two dependency chains, two read streams
    const bool one_w_row = K * static_cast<int64_t>(sizeof(WT)) < ONE_W_ROW_MAX_ROW_BYTES;
#if defined(DP_ISA_AVX2)
    if constexpr (std::is_same_v<WT, bf16>) {  // bf16 W widened without shuffles (cpu_pairs_avx2.h)
      thread_local std::vector<float> xs;
      if (static_cast<int64_t>(xs.size()) < K + 16) xs.resize(K + 16);
      split_pairs(x, K, xs.data());
      int64_t n = n_begin;  // 4 rows at a time measured slower (four read streams)
      for (; !one_w_row && n + 2 <= n_end; n += 2) row_tile_pairs<2>(xs.data(), K, w, ldw, n, n_end, DP_PREFETCH_BYTES, ep);
      for (; n < n_end; ++n) row_tile_pairs<1>(xs.data(), K, w, ldw, n, n_end, DP_PREFETCH_BYTES, ep);
      return;
    }
#endif
    int64_t n = n_begin;
    for (; !one_w_row && n + 2 <= n_end; n += 2) tile_f32<1, 2>(x, ldx, 0, K, w, ldw, n, n_end, ep);
    for (; n < n_end; ++n) tile_f32<1, 1>(x, ldx, 0, K, w, ldw, n, n_end, ep);
    return;
  }
  walk_tiles(M, n_begin, n_end, [&](auto mr, auto nr, int64_t m0, int64_t n0) {
    tile_f32<decltype(mr)::value, decltype(nr)::value>(x, ldx, m0, K, w, ldw, n0, n_end, ep);
  });
}

#if defined(DP_ISA_BF16DOT)
#define DP_BF16DOT_ON 1
// W rows per vdpbf16ps tile against MR rows of x: as many as keep the tile's MR x NR accumulators,
// NR W vectors and one x vector within the 32 vector registers, at most 8 (BF16_TILE_MAX_ROWS).
constexpr int BF16_TILE_MAX_ROWS = 8;
constexpr int bf16_tile_rows(int MR) { return std::min(BF16_TILE_MAX_ROWS, 31 / (MR + 1)); }
// Up to 8 rows of x against W rows shorter than this: one W row per tile (ONE_W_ROW_MAX_ROW_BYTES
// says why). Two threads of a Zen 4, against the tiles of bf16_tile_rows:
// - one row of x: the 0.5B shape's 896-wide matrices (its 152k-row head, gate/up) 1.31-1.38x, the
//   1B shape's 2048-wide ones 1.03-1.09x (all its matrices in a step's order 1.05-1.24x), 4864- and
//   8192-wide ones 0.89-1.00x (there the tiles of several W rows stay);
// - 2 and 4 rows of x (8192 W rows): 896- and 1024-wide 1.18-1.24x, 1536-wide 1.03x, 2048-wide
//   0.86-0.88x, 3072-wide 0.70-0.91x.
constexpr int64_t bf16_one_w_row_max_k(int MR) { return MR == 1 ? ONE_W_ROW_MAX_ROW_BYTES / 2 : 1536; }
// Beyond SMALL_M rows of x: tiles of 6 x rows x 4 W rows (24 accumulators).
constexpr int BF16_TILE_X_ROWS = 6;

// The same for bf16 x and bf16 W with vdpbf16ps (cpu_bf16dot.h). Every output is one tile
// accumulator's sum, in the same order whatever the tile's shape: the results do not depend on it.
// Measured on a Zen 4, 1B bf16 (2048- and 8192-wide rows): with tiles of one W row (each x vector
// reloaded for every W row) decode at batch 2 / 4 / 8 ran 24-26 / 36 / 56-59 tok/s, with these
// 26-29 / 48-54 / 74-77; 6 x 4 tiles at 16 / 32 rows ran 1.03-1.06x the 4 x 4 of walk_tiles. One row
// of x with 8 W rows per tile read the gate/up and down matrices at 0.92-0.98x of the Q8_0 block
// pairs' rate, with 2 W rows at 0.75x, 4 at 0.86x; with one (bf16_one_w_row_max_k) gate/up 1.03-1.09x
// the 8.
template <class EP>
void rows_bf16dot(const bf16* x, int64_t M, int64_t ldx, int64_t K, const bf16* w, int64_t ldw, int64_t n_begin,
                  int64_t n_end, const EP& ep) {
  if (M <= SMALL_M) {  // rows past n_end in the last tile: clamped by the tile, not stored
    with_rows(M, [&](auto mr) {
      constexpr int MR = decltype(mr)::value, TILE_ROWS = bf16_tile_rows(MR);
      if (K < bf16_one_w_row_max_k(MR))
        for (int64_t n = n_begin; n < n_end; ++n) linear_tile_dot<MR, 1>(x, ldx, 0, K, w, ldw, n, n_end, ep);
      else
        for (int64_t n = n_begin; n < n_end; n += TILE_ROWS) linear_tile_dot<MR, TILE_ROWS>(x, ldx, 0, K, w, ldw, n, n_end, ep);
    });
    return;
  }
  constexpr int TILE_ROWS = bf16_tile_rows(BF16_TILE_X_ROWS);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += TILE_ROWS) {
    int64_t m0 = 0;
    for (; m0 + BF16_TILE_X_ROWS <= M; m0 += BF16_TILE_X_ROWS)
      linear_tile_dot<BF16_TILE_X_ROWS, TILE_ROWS>(x, ldx, m0, K, w, ldw, n0, n_end, ep);
    with_rows(M - m0, [&](auto mr) { linear_tile_dot<decltype(mr)::value, TILE_ROWS>(x, ldx, m0, K, w, ldw, n0, n_end, ep); });
  }
}
#else
#define DP_BF16DOT_ON 0
#endif

#if defined(DP_AMX_BUILT)
// From this many rows of x, bf16 x bf16 products run on AMX tiles (where amx_on()); below, the
// vdpbf16ps GEMV (faster there on the Intel Xeon with AMX). dp_amx_set_min_rows changes it (tests).
constexpr int64_t AMX_MIN_ROWS = 4;
inline std::atomic<int64_t>& amx_min_rows() {
  static std::atomic<int64_t> rows{AMX_MIN_ROWS};
  return rows;
}

template <typename T>
bool amx_applies(const WeightDesc& w, int64_t M) {
  return std::is_same_v<T, bf16> && w.format == DP_W_BF16 && M >= amx_min_rows().load(std::memory_order_relaxed) &&
         w.K % 32 == 0 && amx_on();
}

// C blocks ([rows of W][ldc], x rows from m0) through the epilogue: 16 W rows of one x row at a
// time, gathered from the block's column, bias and residual added as 16-lane vectors.
template <class EP>
inline void store_tiles(const EP& ep, const float* c, int64_t ldc, int64_t m0, int64_t m_end, int64_t n0,
                        int64_t num_rows) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int>(ldc)),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  auto widen16 = [](const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  for (int64_t r0 = 0; r0 < num_rows; r0 += 16) {
    const int64_t n = n0 + r0;
    const __m512 bias = ep.bias ? widen16(ep.bias + n) : _mm512_setzero_ps();
    for (int64_t m = m0; m < m_end; ++m) {
      __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + r0 * ldc + (m - m0), 4), bias);
      if (ep.residual) v = _mm512_add_ps(v, widen16(ep.residual + m * ep.ld_residual + n));
      if (ep.out_fp32) {
        _mm512_storeu_ps(static_cast<float*>(ep.out) + m * ep.ld_out + n, v);
      } else {
        const __m256bh h = _mm512_cvtneps_pbh(v);  // round to nearest even, as f2bf
        std::memcpy(static_cast<bf16*>(ep.out) + m * ep.ld_out + n, &h, 32);
      }
    }
  }
}

// W rows [n_begin, n_end) against all M rows of x on AMX tiles (xpack: x packed by amx_pack);
// the last n_end - n_begin mod 16 rows on the vdpbf16ps GEMV.
template <class EP>
__attribute__((target("amx-tile,amx-bf16"))) void rows_amx(const bf16* xpack, const bf16* x, int64_t ldx, int64_t M,
                                                          int64_t K, const bf16* w, int64_t ldw, int64_t n_begin,
                                                          int64_t n_end, const EP& ep) {
  const int64_t num_mb = (M + 15) / 16;
  alignas(64) float c[32 * 32];
  int64_t n = n_begin;
  if (n + 16 <= n_end) {
    amx_configure();
    while (n + 16 <= n_end) {
      const int nb = n + 32 <= n_end ? 2 : 1;
      for (int64_t mb = 0; mb < num_mb; mb += 2) {
        const int mbs = mb + 2 <= num_mb ? 2 : 1;
        const int64_t pf_end = mb + mbs >= num_mb ? n_end : n;  // prefetch the next W block on the last pass
        if (nb == 2 && mbs == 2) amx_block<2, 2>(w, ldw, n, pf_end, K, xpack, mb, c);
        else if (nb == 2) amx_block<2, 1>(w, ldw, n, pf_end, K, xpack, mb, c);
        else if (mbs == 2) amx_block<1, 2>(w, ldw, n, pf_end, K, xpack, mb, c);
        else amx_block<1, 1>(w, ldw, n, pf_end, K, xpack, mb, c);
        const int64_t m_end = std::min(M, 16 * (mb + mbs)), ldc = 16 * mbs;
        store_tiles(ep, c, ldc, 16 * mb, m_end, n, 16 * nb);
      }
      n += 16 * nb;
    }
    amx_release();
  }
  if (n < n_end) rows_bf16dot(x, M, ldx, K, w, ldw, n, n_end, ep);
}
#endif

// Whether a product of M rows of x (element type T) with w runs on AMX tiles here.
template <typename T>
bool use_amx(const WeightDesc& w, int64_t M) {
#if defined(DP_AMX_BUILT)
  return amx_applies<T>(w, M);
#else
  (void)w;
  (void)M;
  return false;
#endif
}

// x as fp32 rows: itself for fp32, else converted once per call into a per-thread buffer.
template <typename T>
const float* fp32_rows(const T* x, int64_t M, int64_t ldx, int64_t K, int64_t* ld_out) {
  if constexpr (sizeof(T) == 4) {
    *ld_out = ldx;
    return x;
  } else {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < M * K) buf.resize(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) buf[m * K + k] = bf2f(x[m * ldx + k]);
    *ld_out = K;
    return buf.data();
  }
}

// W rows [n0, n1) of a dense (F32 / BF16) matrix against M rows of x: bf16 x itself for
// vdpbf16ps (avx512_bf16, bf16 W), else its fp32 rows xf (ldf apart).
template <typename T>
void dense_rows(const T* x, int64_t ldx, const float* xf, int64_t ldf, int64_t M, const WeightDesc& w, int64_t n0,
                int64_t n1, const Epilogue<T>& ep) {
#if defined(DP_ISA_BF16DOT)
  if constexpr (std::is_same_v<T, bf16>) {
    if (w.format == DP_W_BF16) {
      rows_bf16dot(x, M, ldx, w.K, static_cast<const bf16*>(w.data), w.row_bytes / 2, n0, n1, ep);
      return;
    }
  }
#endif
  if (w.format == DP_W_F32)
    rows_f32(xf, M, ldf, w.K, static_cast<const float*>(w.data), w.row_bytes / 4, n0, n1, ep);
  else
    rows_f32(xf, M, ldf, w.K, static_cast<const bf16*>(w.data), w.row_bytes / 2, n0, n1, ep);
}

#if DP_HAS_QUANT
// x's activations for a block-format matrix (dp_quant::prepare, int16 at every batch: see there),
// by one out-of-line instance for every caller: inlined per call site, the compiler may contract
// the multiply-adds of the block sums differently, and the same rows would then get products that
// differ in the last bit between linear_any, the one-region step and the grouped MoE call.
__attribute__((noinline)) void prepare_activations(const WeightDesc& w, const float* x, int64_t M, int64_t ldx,
                                                   void* prepared) {
  dp_quant::prepare(w, x, M, ldx, prepared, false);
}

// W rows [n0, n1) of a block-format matrix against M rows of x (fp32 rows xf, ldf apart, and
// their `prepared` activations), through the epilogue.
template <typename T>
void quant_rows(const WeightDesc& w, const float* xf, int64_t M, int64_t ldf, const void* prepared, int64_t n0,
                int64_t n1, const Epilogue<T>& ep) {
  thread_local std::vector<float> y;
  if (static_cast<int64_t>(y.size()) < M * (n1 - n0)) y.resize(M * (n1 - n0));
  dp_quant::rows(w, xf, M, ldf, prepared, n0, n1, y.data(), n1 - n0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) ep.store(m, n, y[m * (n1 - n0) + n - n0]);
}
#endif

bool format_supported(int32_t format) {
  if (format == DP_W_F32 || format == DP_W_BF16) return true;
#if DP_HAS_QUANT
  return dp_quant::supported(format);
#else
  return false;
#endif
}

// The one entry point of every linear layer: out = x W^T (+ bias) (+ residual) through `ep`.
// Returns 0, or -1 when this build has no kernel for w.format (nothing written).
template <typename T>
int linear_any(const T* x, int64_t M, int64_t ldx, const WeightDesc& w, const Epilogue<T>& ep) {
  const int64_t N = w.N, K = w.K;
  if (!format_supported(w.format)) return -1;
  if (M == 0 || N == 0) return 0;
  const bool bf16dot = std::is_same_v<T, bf16> && w.format == DP_W_BF16 && DP_BF16DOT_ON;
  int64_t ldf = 0;
  const float* xf = bf16dot ? nullptr : fp32_rows(x, M, ldx, K, &ldf);
#if defined(DP_AMX_BUILT)
  if constexpr (std::is_same_v<T, bf16>) {
    if (amx_applies<T>(w, M)) {
      thread_local std::vector<bf16> pack;
      if (static_cast<int64_t>(pack.size()) < amx_pack_elems(M, K)) pack.resize(amx_pack_elems(M, K));
      amx_pack(x, M, ldx, K, pack.data());
      const bf16* xpack = pack.data();
      const bf16* wd = static_cast<const bf16*>(w.data);
      for_row_chunks(M, N, K, [&](int64_t n0, int64_t n1) { rows_amx(xpack, x, ldx, M, K, wd, w.row_bytes / 2, n0, n1, ep); },
                     true);
      return 0;
    }
  }
#endif
  if (w.format == DP_W_F32 || w.format == DP_W_BF16) {
    for_row_chunks(M, N, K, [&](int64_t n0, int64_t n1) { dense_rows(x, ldx, xf, ldf, M, w, n0, n1, ep); });
    return 0;
  }
#if DP_HAS_QUANT
  std::vector<char> prepared(static_cast<size_t>(dp_quant::prepare_bytes(w, M)));
  prepare_activations(w, xf, M, ldf, prepared.data());
  for_row_chunks(M, N, K, [&](int64_t n0, int64_t n1) { quant_rows(w, xf, M, ldf, prepared.data(), n0, n1, ep); });
  return 0;
#else
  return -1;
#endif
}

// ---------------------------------------------------------------------------------------------
// elementwise: RMSNorm, RoPE, SiLU * up
// ---------------------------------------------------------------------------------------------

template <typename T>
void rms_norm(const T* x, int64_t M, int64_t H, int64_t ldx, const T* weight, float eps, T* out) {
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * ldx;
    vf ss = vzero();
    for (int64_t i = 0; i < H; i += 16) {
      const vf v = vload(row + i, H - i);
      ss = vfma(v, v, ss);
    }
    const vf vs = vset1(1.0f / std::sqrt(vsum(ss) / static_cast<float>(H) + eps));
    T* dst = out + m * H;
    for (int64_t i = 0; i < H; i += 16) {
      const vf v = round_like(vmul(vload(row + i, H - i), vs), row);
      vstore(dst + i, vmul(v, vload(weight + i, H - i)), H - i);
    }
  }
}

// qkv rows [M, ld]; the first num_rot_heads heads of head_dim D are rotated in place with
// cos/sin [M, rot/2] (float32): the first rot dims of each head (rot 0: all D; partial rotary).
template <typename T>
void rotary(T* qkv, int64_t M, int64_t ld, int64_t num_rot_heads, int64_t D, const float* cos, const float* sin,
            int64_t rot = 0) {
  const int64_t half = (rot > 0 ? rot : D) / 2;
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cos + m * half;
    const float* s = sin + m * half;
    for (int64_t h = 0; h < num_rot_heads; ++h) {
      T* x = qkv + m * ld + h * D;
      for (int64_t i = 0; i < half; i += 16) {
        const int64_t n = half - i;
        const vf x1 = vload(x + i, n), x2 = vload(x + half + i, n);
        const vf vc = vload(c + i, n), vs = vload(s + i, n);
        vstore(x + i, vfms(x1, vc, vmul(x2, vs)), n);
        vstore(x + half + i, vfma(x2, vc, vmul(x1, vs)), n);
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
      const vf vg = vload(g + i, n);
      const vf e = vexp(vsub(vzero(), vg));
      const vf silu = round_like(vdiv(vg, vadd(vset1(1.0f), e)), g);
      vstore(dst + i, vmul(silu, vload(u + i, n)), n);
    }
  }
}

// ids[m] = the column of row m's maximum, the lowest among ties (torch.max(dim=1)'s index), for
// x [M, N] rows ld apart; -1 for a row holding a NaN (the caller falls back), found by the row's
// sum (NaN also for a row holding both infinities, or overflowing to them: -1 too). The max by
// vmax in blocks of 16, then the first span of 256 holding it, then its first column there.
void first_max_rows(const float* x, int64_t M, int64_t N, int64_t ld, int64_t* ids) {
  constexpr int64_t SPAN = 256;
#pragma omp parallel for schedule(static) if (M * N >= (1 << 18))
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ld;
    vf acc = vset1(-INFINITY), sum = vzero();
    for (int64_t n = 0; n < N; n += 16) {
      const vf v = vkeep_first(vload(row + n, N - n), N - n, -INFINITY);
      acc = vmax(acc, v);
      sum = vadd(sum, v);
    }
    if (std::isnan(vsum(sum))) {
      ids[m] = -1;
      continue;
    }
    const float best = vmaxr(acc);
    int64_t at = 0;
    for (; at + SPAN <= N; at += SPAN) {
      vf span = vset1(-INFINITY);
      for (int64_t n = at; n < at + SPAN; n += 16) span = vmax(span, vload(row + n));
      if (vmaxr(span) == best) break;
    }
    while (at < N && !(row[at] == best)) ++at;
    ids[m] = at < N ? at : -1;
  }
}

}  // namespace

extern "C" {

// The variant this library was compiled as, and whether the CPU it runs on has its features.
const char* dp_variant_name() {
#if defined(DP_ISA_BF16DOT)
  return "avx512_bf16";
#elif defined(DP_ISA_AVX512)
  return "avx512";
#elif defined(DP_ISA_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

int dp_variant_supported() {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(DP_GENERIC)
#if defined(DP_ISA_BF16DOT)
  if (!__builtin_cpu_supports("avx512bf16")) return 0;
#endif
#if defined(DP_ISA_AVX512)
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
    return 0;
#endif
#if defined(DP_ISA_AVX2)
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) return 0;
#endif
#endif
  return 1;
}

int dp_weight_format_supported(int32_t format) { return format_supported(format) ? 1 : 0; }

// AMX tiles for bf16 x bf16 products of AMX_MIN_ROWS+ rows: 1 to allow (the default), 0 to turn
// them off, another value leaves it; returns 1 when they run from now on (built into this
// variant, amx_bf16 on the CPU, tile data permitted to the process), else 0.
int dp_amx_set_enabled(int enable) {
#if defined(DP_AMX_BUILT)
  if (enable == 0 || enable == 1) amx_enabled_flag().store(enable);
  return amx_on() ? 1 : 0;
#else
  (void)enable;
  return 0;
#endif
}

// The fewest rows of x that run on AMX tiles: set to `rows` when it is >= 1; returns the value
// in force before the call (0 in a build without AMX tiles).
int64_t dp_amx_min_rows(int64_t rows) {
#if defined(DP_AMX_BUILT)
  return rows >= 1 ? amx_min_rows().exchange(rows) : amx_min_rows().load();
#else
  (void)rows;
  return 0;
#endif
}

// quant_gemv.h's activation arithmetic for block formats (0 fp32, 1 int16, 2 int8;
// another value leaves it); returns the mode in force, -1 in a build without quant_gemv.h.
int32_t dp_quant_set_activations(int32_t mode) {
#if DP_HAS_QUANT
  return dp_quant::set_activation_mode(mode);
#else
  (void)mode;
  return -1;
#endif
}

// out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) (+ residual[m, n], which may alias out); out in
// the input type or fp32 (out_fp32). x rows are ldx apart; out rows ld_out apart. Returns 0, or
// -1 when the weight format has no kernel in this build (nothing written).
int dp_linear_bf16(const bf16* x, int64_t M, int64_t ldx, const WeightDesc* w, const bf16* bias, const bf16* residual,
                   int64_t ld_residual, void* out, int64_t ld_out, int out_fp32) {
  return linear_any(x, M, ldx, *w, Epilogue<bf16>{bias, residual, ld_residual, out, ld_out, out_fp32});
}
int dp_linear_f32(const float* x, int64_t M, int64_t ldx, const WeightDesc* w, const float* bias,
                  const float* residual, int64_t ld_residual, void* out, int64_t ld_out, int out_fp32) {
  return linear_any(x, M, ldx, *w, Epilogue<float>{bias, residual, ld_residual, out, ld_out, out_fp32});
}

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
void dp_first_max_rows_f32(const float* x, int64_t M, int64_t N, int64_t ld, int64_t* ids) {
  first_max_rows(x, M, N, ld, ids);
}

// dst[i] = src[i] as float32, in parallel: a bf16 matrix widened once per prefill step for oneDNN's
// fp32 GEMM (bf16 matrices with fp32 compute), about as fast as the memory moves.
void dp_bf16_to_f32(const bf16* src, int64_t n, float* dst) {
  constexpr int64_t CHUNK = 1 << 16;
#pragma omp parallel for schedule(static) if (n >= 4 * CHUNK)
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int64_t end = std::min(n, c + CHUNK);
    for (int64_t i = c; i < end; i += 16) vstore(dst + i, vload(src + i, end - i), end - i);
  }
}

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

}  // extern "C"

namespace {

// q [B, heads * D] (rows ldq apart); caches [blocks, block_size, kv_heads, D]; tables
// [B, ld_tables] int64; context_lens [B] int64; out [B, heads * D] rows ld_out apart.
template <typename T>
int decode_attention_any(const T* q, int64_t ldq, const T* k, const T* v, int64_t num_blocks, const int64_t* tables,
                         int64_t ld_tables, const int64_t* lens, int64_t B, const AttnShape& s, float scale, T* out,
                         int64_t ld_out) {
  return with_head_dim<T>(s.head_dim, [&](auto nd, auto ng) {
    return decode_attention<T, decltype(nd)::value, decltype(ng)::value>(q, ldq, k, v, num_blocks, tables, ld_tables,
                                                                          lens, B, s, scale, out, ld_out);
  });
}

}  // namespace

extern "C" {

// Returns 0; -1 when head_dim is not supported (caller falls back); -2 for a bad length or block id.
int dp_decode_attention_bf16(const bf16* q, int64_t ldq, const bf16* k, const bf16* v, int64_t num_blocks,
                             const int64_t* tables, int64_t ld_tables, const int64_t* lens, int64_t B,
                             int64_t block_size, int64_t kv_heads, int64_t group, int64_t D, float scale, bf16* out,
                             int64_t ld_out) {
  return decode_attention_any(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B,
                              AttnShape{block_size, kv_heads, group, D}, scale, out, ld_out);
}
int dp_decode_attention_f32(const float* q, int64_t ldq, const float* k, const float* v, int64_t num_blocks,
                            const int64_t* tables, int64_t ld_tables, const int64_t* lens, int64_t B,
                            int64_t block_size, int64_t kv_heads, int64_t group, int64_t D, float scale, float* out,
                            int64_t ld_out) {
  return decode_attention_any(q, ldq, k, v, num_blocks, tables, ld_tables, lens, B,
                              AttnShape{block_size, kv_heads, group, D}, scale, out, ld_out);
}

}  // extern "C"

namespace {

bool is_dense(const WeightDesc& w) { return w.format == DP_W_F32 || w.format == DP_W_BF16; }

// A matrix the one-region step can run: dense, or a block format this build has kernels for
// (its activations are prepared once per matrix, by a single-task stage, then the W row chunks
// are tasks like a dense matrix's).
bool staged_format(const WeightDesc& w) {
#if DP_HAS_QUANT
  return is_dense(w) || dp_quant::supported(w.format);
#else
  return is_dense(w);
#endif
}

// rows [M, K] (ld apart) as fp32 rows K apart in dst (bf16), or nothing to do (fp32: used as is).
template <typename T>
void widen_rows(const T* src, int64_t M, int64_t K, int64_t ld, float* dst) {
  if constexpr (sizeof(T) == 2)  // exact: bf16 -> fp32 is a shift (vload), 16 at a time
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 16) vstore(dst + m * K + k, vload(src + m * ld + k, K - k), K - k);
}

}  // namespace

#include "cpu_moe.h"  // a MoE layer's routing and experts, run by the decode step's MoE layers

// ---------------------------------------------------------------------------------------------
// one whole decoder layer for a decode-only step of at most 8 sequences (one call per layer:
// no Python between the ops, no intermediate tensors allocated)
// ---------------------------------------------------------------------------------------------

namespace {

// Static per layer (weights and this layer's cache); filled once per model and KV storage.
// Norms and the qkv bias are in the activations' type T; the four matrices in any format.
struct LayerArgs {
  int64_t H, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, scale;
  const void *input_norm, *qkv_b, *post_norm;
  WeightDesc qkv_w, o_w, gate_up_w, down_w;
  void *k_cache, *v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  int64_t num_blocks, block_size;
  const void *q_norm, *k_norm;  // [head_dim] RMSNorm weights of every q / k head (Qwen3), or null
  int64_t rotary_dim;           // dims of each head RoPE rotates (partial rotary, Phi-3); 0: head_dim
  // Rows [qkv_w.N, qkv_w.N + N) of the qkv matrix where they are in another block format than
  // qkv_w's (a Q4_K_M file: Q4_K q and k rows, Q6_K v rows); N = 0: qkv_w holds them all.
  WeightDesc qkv_tail_w;
  // A mixture-of-experts layer: its router [E, H] and routed experts (cpu_moe.h) in place of
  // gate_up_w and down_w, each row's top_k experts weighted as route_rows does (norm_topk_prob:
  // 0 or 1); moe null: a dense MLP.
  WeightDesc router_w;
  const MoeExpertsArgs* moe;
  int64_t top_k, norm_topk_prob;
};

bool has_tail(const LayerArgs& a) { return a.qkv_tail_w.N > 0; }
bool is_moe(const LayerArgs& a) { return a.moe != nullptr; }

// A MoE layer's router and experts have the shapes the layer names, in formats this build runs.
bool moe_layer_supported(const LayerArgs& a) {
  const MoeExpertsArgs& e = *a.moe;
  return staged_format(a.router_w) && a.router_w.N == e.num_experts && a.router_w.K == a.H && e.hidden == a.H &&
         a.top_k >= 1 && a.top_k <= std::min(e.num_experts, MOE_MAX_TOP_K) && moe_experts_supported(e);
}

// The qkv epilogue of the rows from n0 on: bias and output moved to that row.
template <typename T>
Epilogue<T> qkv_epilogue(const LayerArgs& a, T* qkv, int64_t qkv_size, int64_t n0) {
  const T* bias = static_cast<const T*>(a.qkv_b);
  return Epilogue<T>{bias == nullptr ? nullptr : bias + n0, nullptr, 0, qkv + n0, qkv_size, 0};
}

// Per step, shared by all layers.
struct StepArgs {
  int64_t M;
  const float *cos, *sin;  // [M, rotary dims / 2]
  const int64_t* slots;    // [M]
  const int64_t* tables;   // [M, ld_tables]
  int64_t ld_tables;
  const int64_t* lens;  // [M]
  void* scratch;        // M * (H + qkv + heads * D + 2 I + I) elements
};

// The final norm and LM head, when the step's call computes the logits too (dp_decode_step_*):
// logits [M, lm_head.N] fp32 = lm_head(rms_norm(hidden, final_norm)).
struct HeadArgs {
  const void* final_norm;
  float eps;
  WeightDesc lm_head;
};

// A layer's views of the step scratch, and its sizes.
template <typename T>
struct LayerBuffers {
  int64_t M, H, D, I, q_size, kv_size, qkv_size;
  T *x, *qkv, *attn, *gate_up, *act;
  LayerBuffers(const LayerArgs& a, const StepArgs& st)
      : M(st.M), H(a.H), D(a.head_dim), I(a.intermediate), q_size(a.num_heads * a.head_dim),
        kv_size(a.num_kv_heads * a.head_dim), qkv_size(q_size + 2 * kv_size) {
    x = static_cast<T*>(st.scratch);
    qkv = x + M * H;
    attn = qkv + M * qkv_size;
    gate_up = attn + M * q_size;
    act = gate_up + M * 2 * I;
  }
};

// RMSNorm in place over num_q_heads q heads at q and num_k_heads k heads at k (one row of qkv), where
// the layer has q/k norms: before RoPE, as the reference does.
template <typename T>
void qk_norm(const LayerArgs& a, T* q, int64_t num_q_heads, T* k, int64_t num_k_heads) {
  if (a.q_norm == nullptr) return;
  rms_norm(q, num_q_heads, a.head_dim, a.head_dim, static_cast<const T*>(a.q_norm), a.eps, q);
  rms_norm(k, num_k_heads, a.head_dim, a.head_dim, static_cast<const T*>(a.k_norm), a.eps, k);
}

// q/k norms and RoPE over q and k, then k and v into their cache slots (checked by the caller).
template <typename T>
void rope_and_write_kv(const LayerArgs& a, const StepArgs& st, const LayerBuffers<T>& b) {
  for (int64_t m = 0; m < b.M; ++m) {
    T* row = b.qkv + m * b.qkv_size;
    qk_norm(a, row, a.num_heads, row + b.q_size, a.num_kv_heads);
  }
  rotary(b.qkv, b.M, b.qkv_size, a.num_heads + a.num_kv_heads, b.D, st.cos, st.sin, a.rotary_dim);
  T* k_cache = static_cast<T*>(a.k_cache);
  T* v_cache = static_cast<T*>(a.v_cache);
  for (int64_t m = 0; m < b.M; ++m) {
    std::memcpy(k_cache + st.slots[m] * b.kv_size, b.qkv + m * b.qkv_size + b.q_size, b.kv_size * sizeof(T));
    std::memcpy(v_cache + st.slots[m] * b.kv_size, b.qkv + m * b.qkv_size + b.q_size + b.kv_size,
                b.kv_size * sizeof(T));
  }
}

// Attention of sequences [b0, b0 + num_seqs) of the step.
template <typename T>
int attend_layer(const LayerArgs& a, const StepArgs& st, const LayerBuffers<T>& b, int64_t b0, int64_t num_seqs) {
  const AttnShape shape{a.block_size, a.num_kv_heads, a.num_heads / a.num_kv_heads, b.D};
  return decode_attention_any<T>(b.qkv + b0 * b.qkv_size, b.qkv_size, static_cast<const T*>(a.k_cache),
                                 static_cast<const T*>(a.v_cache), a.num_blocks, st.tables + b0 * st.ld_tables,
                                 st.ld_tables, st.lens + b0, num_seqs, shape, a.scale, b.attn + b0 * b.q_size,
                                 b.q_size);
}

// hidden [M, H] += a MoE layer's routed experts over x (its normed rows), per operation: the
// router, the routing, then the experts' own region (moe_experts).
template <typename T>
int moe_layer_mlp(T* hidden, const T* x, const LayerArgs& a, int64_t M) {
  const int64_t E = a.moe->num_experts, k = a.top_k;
  std::vector<T> logits(M * E), weights(M * k);
  std::vector<int64_t> ids(M * k);
  const T* none = nullptr;
  if (linear_any(x, M, a.H, a.router_w, Epilogue<T>{none, none, 0, logits.data(), E, 0}) != 0) return -1;
  route_rows(logits.data(), M, E, k, a.norm_topk_prob != 0, ids.data(), weights.data());
  return moe_experts(x, M, a.H, ids.data(), weights.data(), k, *a.moe, hidden, hidden) != 0 ? -1 : 0;
}

template <typename T>
int decode_layer(T* hidden, const LayerArgs& a, const StepArgs& st) {
  const LayerBuffers<T> b(a, st);
  const int64_t M = b.M, H = b.H, I = b.I, q_size = b.q_size, qkv_size = b.qkv_size;
  T *x = b.x, *qkv = b.qkv, *attn = b.attn, *gate_up = b.gate_up, *act = b.act;
  const int64_t num_slots = a.num_blocks * a.block_size;
  for (int64_t m = 0; m < M; ++m)
    if (st.slots[m] < 0 || st.slots[m] >= num_slots) return -2;
  const T* none = nullptr;
  int status = 0;

  rms_norm(hidden, M, H, H, static_cast<const T*>(a.input_norm), a.eps, x);
  status |= linear_any(x, M, H, a.qkv_w, qkv_epilogue(a, qkv, qkv_size, 0));
  if (has_tail(a)) status |= linear_any(x, M, H, a.qkv_tail_w, qkv_epilogue(a, qkv, qkv_size, a.qkv_w.N));
  if (status != 0) return -1;
  rope_and_write_kv(a, st, b);
  status = attend_layer(a, st, b, 0, M);
  if (status != 0) return status;
  status |= linear_any(attn, M, q_size, a.o_w, Epilogue<T>{none, hidden, H, hidden, H, 0});
  rms_norm(hidden, M, H, H, static_cast<const T*>(a.post_norm), a.eps, x);
  if (is_moe(a)) return status != 0 ? -1 : moe_layer_mlp(hidden, x, a, M);
  status |= linear_any(x, M, H, a.gate_up_w, Epilogue<T>{none, none, 0, gate_up, 2 * I, 0});
  silu_mul(gate_up, M, I, act);
  status |= linear_any(act, M, I, a.down_w, Epilogue<T>{none, hidden, H, hidden, H, 0});
  return status != 0 ? -1 : 0;
}

// ---- the same step as one parallel region (cpu_step_stages.h) ----

// Tokens of context of the step's longest sequence (whole blocks, as decode_attention counts
// them), or -1 when a length or block id is out of range.
int64_t checked_longest_context(const StepArgs& st, int64_t block_size, int64_t num_blocks) {
  int64_t longest = 0;
  for (int64_t b = 0; b < st.M; ++b) {
    const int64_t nb = (st.lens[b] + block_size - 1) / block_size;
    if (st.lens[b] < 1 || nb > st.ld_tables) return -1;
    for (int64_t i = 0; i < nb; ++i)
      if (st.tables[b * st.ld_tables + i] < 0 || st.tables[b * st.ld_tables + i] >= num_blocks) return -1;
    longest = std::max(longest, nb * block_size);
  }
  return longest;
}

// Whether the step runs as one region: every matrix dense or block-quantized, and either at least
// as many sequences as threads (a sequence is one attention task there), or a lone sequence of a
// model with at least as many kv heads as threads (a kv head is one task: rope_kv_attend_head), or
// every sequence's attention small enough that decode_attention would run it on one thread anyway
// (other few, long sequences keep decode_attention's own split of a sequence across threads).
// dp_set_decode_one_region(0) turns it off (tests compare both paths).
std::atomic<int>& one_region_flag() {
  static std::atomic<int> enabled{1};
  return enabled;
}

bool staged_applies(const LayerArgs* layers, int64_t num_layers, const StepArgs& st) {
  if (one_region_flag().load(std::memory_order_relaxed) == 0) return false;
  for (int64_t i = 0; i < num_layers; ++i) {
    const LayerArgs& a = layers[i];
    if (!staged_format(a.qkv_w) || !staged_format(a.o_w) ||
        (!is_moe(a) && (!staged_format(a.gate_up_w) || !staged_format(a.down_w))))
      return false;
    // a split qkv: two block-format runs (each with its own prepared activations, no AMX packing)
    if (has_tail(a) && (is_dense(a.qkv_w) || is_dense(a.qkv_tail_w) || !staged_format(a.qkv_tail_w))) return false;
    const int64_t tokens = checked_longest_context(st, a.block_size, a.num_blocks);
    if (tokens < 0) return false;
    const bool per_head = st.M == 1 && a.num_kv_heads >= omp_get_max_threads();
    if (st.M < omp_get_max_threads() && !per_head && tokens * a.num_heads * a.head_dim >= PARALLEL_MIN_MACS)
      return false;
  }
  return true;
}

// Query heads of kv head h of the step's only sequence: q/k norms and RoPE over them and over k head h, k and v
// head h into the cache slot, then their attention. The same arithmetic per head as
// rope_and_write_kv + attend_layer (every head's rotation and attention is its own), split so that
// a lone sequence's attention runs on several threads (kv heads) instead of one.
template <typename T>
int rope_kv_attend_head(const LayerArgs& a, const StepArgs& st, const LayerBuffers<T>& b, int64_t h) {
  const int64_t G = a.num_heads / a.num_kv_heads, D = b.D;
  T* q = b.qkv + h * G * D;
  T* k = b.qkv + b.q_size + h * D;
  qk_norm(a, q, G, k, 1);
  rotary(q, 1, b.qkv_size, G, D, st.cos, st.sin, a.rotary_dim);
  rotary(k, 1, b.qkv_size, 1, D, st.cos, st.sin, a.rotary_dim);
  T* k_cache = static_cast<T*>(a.k_cache) + h * D;
  T* v_cache = static_cast<T*>(a.v_cache) + h * D;
  std::memcpy(k_cache + st.slots[0] * b.kv_size, k, D * sizeof(T));
  std::memcpy(v_cache + st.slots[0] * b.kv_size, k + b.kv_size, D * sizeof(T));
  const AttnShape shape{a.block_size, 1, G, D, b.kv_size};
  return decode_attention_any<T>(q, b.qkv_size, k_cache, v_cache, a.num_blocks, st.tables, st.ld_tables, st.lens, 1,
                                 shape, a.scale, b.attn + h * G * D, b.q_size);
}

// decode_layer's stages for every layer, in one parallel region: per layer 0 norm, 1 qkv, 2 rope +
// KV write, 3 attention (a task per sequence), 4 the o matrix's activations prepared (block
// formats; nothing for a dense one), 5 o + residual, 6 norm, 7 gate/up, 8 silu*up, 9 down +
// residual; the matrices in chunks of W rows (chunk_rows), the rest one task each. The single-task
// stages before the other matrices (0, 6, 8) prepare those matrices' activations themselves. A MoE
// layer runs 7 as its router instead, 8 as the routing and grouping of its rows by expert, and 9-13
// as the stages 0-4 of its routed experts (cpu_moe.h; the last one adds the residual); a dense
// layer has no tasks in 10-13. Same arithmetic as decode_layer. Inputs are checked before the
// region (staged_applies, the slots here).
// With `head`, two more stages after the last layer: the final norm (preparing the LM head's
// activations), then the LM head in row chunks into `logits`: the head's weights (a fifth of the
// default model's bf16 bytes) stream inside the same region instead of in a call of their own.
template <typename T>
int decode_layers_staged(T* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs& st,
                         const HeadArgs* head, float* logits) {
  constexpr int64_t STAGES = 14;
  const int64_t M = st.M, head_stage = num_layers * STAGES;
  const int threads = omp_get_max_threads();
  std::vector<int64_t> begin(1, 0), rows_per_chunk(head_stage + 2, 0);
  std::vector<int64_t> tail_rows_per_chunk(num_layers, 1), head_chunks(num_layers, 0);  // a split qkv's
  // A lone sequence's RoPE, KV write and attention as one task per kv head (rope_kv_attend_head).
  const bool per_head = M == 1 && threads > 1;
  int64_t widest = 0, prepared_bytes = 0, tail_prepared_bytes = 0, most_experts = 0, most_choices = 0;
  bool any_amx = false;
  for (int64_t i = 0; i < num_layers; ++i) {
    const LayerArgs& a = layers[i];
    for (int64_t m = 0; m < M; ++m)
      if (st.slots[m] < 0 || st.slots[m] >= a.num_blocks * a.block_size) return -2;
    const bool moe = is_moe(a);
    const WeightDesc* mlp_in = moe ? &a.router_w : &a.gate_up_w;
    const WeightDesc* mats[STAGES] = {nullptr, &a.qkv_w, nullptr, nullptr, nullptr, &a.o_w, nullptr, mlp_in,
                                      nullptr, moe ? nullptr : &a.down_w};
    if (moe) {
      most_experts = std::max(most_experts, a.moe->num_experts);
      most_choices = std::max(most_choices, a.top_k);
    }
#if DP_HAS_QUANT
    for (const WeightDesc* w : mats)
      if (w != nullptr && !is_dense(*w)) prepared_bytes = std::max(prepared_bytes, dp_quant::prepare_bytes(*w, M));
    if (has_tail(a)) tail_prepared_bytes = std::max(tail_prepared_bytes, dp_quant::prepare_bytes(a.qkv_tail_w, M));
#endif
    for (int64_t s = 0; s < STAGES; ++s) {
      int64_t tasks = s == 3 ? M : s < 10 ? 1 : 0;  // attention: one task per sequence; 10-13: MoE only
      if (moe && s >= 9) {  // the routed experts: as many tasks as the routing may need (cpu_moe.h)
        const int64_t most = ExpertGroups<T>::max_selected(*a.moe, M, a.top_k);
        const int64_t chunks =
            ExpertGroups<T>::max_chunks(*a.moe, s == 10 ? 2 * a.moe->intermediate : a.H, M, a.top_k, threads);
        tasks = s == 9 || s == 11 ? most : s == 10 || s == 12 ? chunks : ExpertGroups<T>::sum_tasks(M);
      }
      if (per_head && s == 2) tasks = 0;  // RoPE and the KV write are done per kv head, in stage 3
      if (per_head && s == 3) tasks = a.num_kv_heads;
      if (s == 4 && is_dense(a.o_w) && !use_amx<T>(a.o_w, M)) tasks = 0;  // nothing to prepare
      if (mats[s] != nullptr) {
        const bool amx = use_amx<T>(*mats[s], M);
        any_amx = any_amx || amx;
        rows_per_chunk[i * STAGES + s] = amx ? amx_chunk_rows(M, mats[s]->N, threads) : chunk_rows(M, mats[s]->N, threads);
        tasks = (mats[s]->N + rows_per_chunk[i * STAGES + s] - 1) / rows_per_chunk[i * STAGES + s];
        widest = std::max(widest, mats[s]->K);
        if (s == 1 && has_tail(a)) {  // the tail's row chunks follow the head's in the same stage
          head_chunks[i] = tasks;
          tail_rows_per_chunk[i] = chunk_rows(M, a.qkv_tail_w.N, threads);
          tasks += (a.qkv_tail_w.N + tail_rows_per_chunk[i] - 1) / tail_rows_per_chunk[i];
        }
      }
      begin.push_back(begin.back() + tasks);
    }
  }
  if (head != nullptr) {
    const WeightDesc& w = head->lm_head;
#if DP_HAS_QUANT
    if (!is_dense(w)) prepared_bytes = std::max(prepared_bytes, dp_quant::prepare_bytes(w, M));
#endif
    const bool amx = use_amx<T>(w, M);
    any_amx = any_amx || amx;
    rows_per_chunk[head_stage + 1] = amx ? amx_chunk_rows(M, w.N, threads) : chunk_rows(M, w.N, threads);
    widest = std::max(widest, w.K);
    begin.push_back(begin.back() + 1);
    begin.push_back(begin.back() + (w.N + rows_per_chunk[head_stage + 1] - 1) / rows_per_chunk[head_stage + 1]);
  }
  std::vector<float> xf_buf(sizeof(T) == 2 ? M * widest : 0);  // the fp32 rows of the next matrix's x
  float* const xf = xf_buf.data();
  // The next block-format matrix's prepared activations: one buffer, since a stage starts only
  // once every task of the earlier ones is done.
  std::vector<char> prepared_buf(static_cast<size_t>(prepared_bytes));
  char* const prepared = prepared_buf.data();
  std::vector<char> tail_prepared_buf(static_cast<size_t>(tail_prepared_bytes));  // a split qkv's tail
  char* const tail_prepared = tail_prepared_buf.data();
  // The next AMX matrix's x packed for B tiles (amx_pack), by the same single-task stages.
#if defined(DP_AMX_BUILT)
  std::vector<bf16> amx_buf(any_amx ? static_cast<size_t>(amx_pack_elems(M, widest)) : 0);
  bf16* const amx_pack_out = amx_buf.data();
#else
  (void)any_amx;
#endif
  // A MoE layer's router logits, routing and grouped experts (one set: the layers run in turn).
  std::vector<T> router_logits(M * most_experts), route_weights(M * most_choices);
  std::vector<int64_t> route_ids(M * most_choices);
  thread_local ExpertGroups<T> kept;  // its buffers kept between this thread's steps
  ExpertGroups<T>& groups = kept;     // the region's threads use this one (not a thread_local of their own)
  std::atomic<int> failed{0};
  run_stages(begin, [&](int64_t stage, int64_t task) {
    const LayerArgs& a = layers[std::min(stage / STAGES, num_layers - 1)];
    const LayerBuffers<T> b(a, st);
    const int64_t H = b.H, I = b.I, q_size = b.q_size, qkv_size = b.qkv_size;
    T *x = b.x, *qkv = b.qkv, *attn = b.attn, *gate_up = b.gate_up, *act = b.act;
    const T* none = nullptr;
    const int64_t rows = rows_per_chunk[stage];
    auto fp32_in = [&](const T* in) { return sizeof(T) == 2 ? xf : reinterpret_cast<const float*>(in); };
    auto prepare = [&](const T* in, int64_t ld_in, const WeightDesc& w, char* prep = nullptr) {
#if defined(DP_AMX_BUILT)
      if constexpr (std::is_same_v<T, bf16>)
        if (use_amx<T>(w, M)) amx_pack(in, M, ld_in, w.K, amx_pack_out);
#endif
#if DP_HAS_QUANT
      if (!is_dense(w)) prepare_activations(w, fp32_in(in), M, sizeof(T) == 2 ? w.K : ld_in, prep ? prep : prepared);
#else
      (void)prep;
#endif
    };
    // Row chunk t of `w` (chunks of r rows; prep: its prepared activations, null: `prepared`).
    auto chunk = [&](const T* in, int64_t ld_in, const WeightDesc& w, const Epilogue<T>& ep, int64_t t = -1,
                     int64_t r = 0, const char* prep = nullptr) {
      if (t < 0) t = task, r = rows;
      const int64_t ldf = sizeof(T) == 2 ? w.K : ld_in, n0 = t * r, n1 = std::min(w.N, (t + 1) * r);
#if defined(DP_AMX_BUILT)
      if constexpr (std::is_same_v<T, bf16>)
        if (use_amx<T>(w, M)) {
          rows_amx(amx_pack_out, in, ld_in, M, w.K, static_cast<const bf16*>(w.data), w.row_bytes / 2, n0, n1, ep);
          return;
        }
#endif
      if (is_dense(w)) {
        dense_rows(in, ld_in, fp32_in(in), ldf, M, w, n0, n1, ep);
        return;
      }
#if DP_HAS_QUANT
      quant_rows(w, fp32_in(in), M, ldf, prep ? prep : prepared, n0, n1, ep);
#else
      (void)prep;
#endif
    };
    if (stage >= head_stage) {  // the final norm, then the LM head's row chunks
      const WeightDesc& w = head->lm_head;
      if (stage == head_stage) {
        rms_norm(hidden, M, H, H, static_cast<const T*>(head->final_norm), head->eps, x);
        widen_rows(x, M, H, H, xf);
        prepare(x, H, w);
      } else {
        chunk(x, H, w, Epilogue<T>{none, none, 0, logits, w.N, 1});
      }
      return;
    }
    switch (stage % STAGES) {
      case 0:
        rms_norm(hidden, M, H, H, static_cast<const T*>(a.input_norm), a.eps, x);
        widen_rows(x, M, H, H, xf);
        prepare(x, H, a.qkv_w);
        if (has_tail(a)) prepare(x, H, a.qkv_tail_w, tail_prepared);
        break;
      case 1: {
        const int64_t i = stage / STAGES;
        if (!has_tail(a) || task < head_chunks[i])
          chunk(x, H, a.qkv_w, qkv_epilogue(a, qkv, qkv_size, 0));
        else
          chunk(x, H, a.qkv_tail_w, qkv_epilogue(a, qkv, qkv_size, a.qkv_w.N), task - head_chunks[i],
                tail_rows_per_chunk[i], tail_prepared);
        break;
      }
      case 2:
        rope_and_write_kv(a, st, b);
        break;
      case 3:
        if (per_head) {  // task = kv head of the only sequence
          const int64_t gd = q_size / a.num_kv_heads;
          if (rope_kv_attend_head(a, st, b, task) != 0) failed.store(1);
          widen_rows(attn + task * gd, 1, gd, gd, xf + task * gd);
          break;
        }
        if (attend_layer(a, st, b, task, 1) != 0) failed.store(1);
        widen_rows(attn + task * q_size, 1, q_size, q_size, xf + task * q_size);
        break;
      case 4:
        prepare(attn, q_size, a.o_w);
        break;
      case 5:
        chunk(attn, q_size, a.o_w, Epilogue<T>{none, hidden, H, hidden, H, 0});
        break;
      case 6:
        rms_norm(hidden, M, H, H, static_cast<const T*>(a.post_norm), a.eps, x);
        widen_rows(x, M, H, H, xf);
        prepare(x, H, is_moe(a) ? a.router_w : a.gate_up_w);
        break;
      case 7:
        if (is_moe(a))
          chunk(x, H, a.router_w, Epilogue<T>{none, none, 0, router_logits.data(), a.router_w.N, 0});
        else
          chunk(x, H, a.gate_up_w, Epilogue<T>{none, none, 0, gate_up, 2 * I, 0});
        break;
      case 8:
        if (is_moe(a)) {
          route_rows(router_logits.data(), M, a.router_w.N, a.top_k, a.norm_topk_prob != 0, route_ids.data(),
                     route_weights.data());
          groups.group(*a.moe, route_ids.data(), M, a.top_k, threads);
          break;
        }
        silu_mul(gate_up, M, I, act);
        widen_rows(act, M, I, I, xf);
        prepare(act, I, a.down_w);
        break;
      case 9:
        if (is_moe(a))
          groups.gather(task, x, H);
        else
          chunk(act, I, a.down_w, Epilogue<T>{none, hidden, H, hidden, H, 0});
        break;
      case 10:
        groups.gate_up(task, begin[stage + 1] - begin[stage]);
        break;
      case 11:
        groups.activate(task);
        break;
      case 12:
        groups.down(task, begin[stage + 1] - begin[stage]);
        break;
      default:
        groups.sum_rows(task, route_weights.data(), hidden, hidden, H);
    }
  });
  return failed.load() != 0 ? -1 : 0;
}

// Checks what would make a layer fail half-way (an unsupported format or head_dim) before any
// layer runs, so that -1 means nothing was done.
template <typename T>
int decode_layers(T* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs* step,
                  const HeadArgs* head = nullptr, float* logits = nullptr) {
  for (int64_t i = 0; i < num_layers; ++i) {
    const LayerArgs& a = layers[i];
    if (!format_supported(a.qkv_w.format) || !format_supported(a.o_w.format) ||
        (has_tail(a) && !format_supported(a.qkv_tail_w.format)) ||
        (is_moe(a) ? !moe_layer_supported(a)
                   : !format_supported(a.gate_up_w.format) || !format_supported(a.down_w.format)) ||
        with_head_dim<T>(a.head_dim, [](auto, auto) { return 0; }) != 0)
      return -1;
  }
  if (head != nullptr && (num_layers == 0 || !format_supported(head->lm_head.format) ||
                          head->lm_head.K != layers[0].H || logits == nullptr))
    return -1;
  if (num_layers > 0 && step->M > 0 && staged_applies(layers, num_layers, *step) &&
      (head == nullptr || staged_format(head->lm_head)))
    return decode_layers_staged(hidden, layers, num_layers, *step, head, logits);
  for (int64_t i = 0; i < num_layers; ++i) {
    const int status = decode_layer(hidden, layers[i], *step);
    if (status != 0) return status;
  }
  if (head == nullptr || step->M == 0) return 0;
  const int64_t H = layers[0].H;
  T* x = static_cast<T*>(step->scratch);  // the first M * H elements: free after the last layer
  rms_norm(hidden, step->M, H, H, static_cast<const T*>(head->final_norm), head->eps, x);
  const T* none = nullptr;
  return linear_any(x, step->M, H, head->lm_head, Epilogue<T>{none, none, 0, logits, head->lm_head.N, 1});
}

}  // namespace

extern "C" {

// Whether a decode step that allows it runs as one parallel region (1, the default) or as one
// region per operation (0): set to `enable` when it is 0 or 1; returns the value in force before
// the call. For tests, which prove both paths give the same results; not while a step runs.
int dp_set_decode_one_region(int enable) {
  const int before = one_region_flag().load();
  if (enable == 0 || enable == 1) one_region_flag().store(enable);
  return before;
}

// All layers of a decode step; hidden [M, H] is updated in place. Returns 0; -1 for an
// unsupported head_dim or weight format (nothing done); -2 for a slot, context length or block
// id out of range (found before anything is read or written through it).
int dp_decode_layers_bf16(bf16* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs* step) {
  return decode_layers(hidden, layers, num_layers, step);
}
int dp_decode_layers_f32(float* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs* step) {
  return decode_layers(hidden, layers, num_layers, step);
}

// The same, then the final norm and LM head: logits [M, head->lm_head.N] fp32 (hidden keeps the
// last layer's output). -1 also when the LM head's format has no kernel or its K is not H.
int dp_decode_step_bf16(bf16* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs* step,
                        const HeadArgs* head, float* logits) {
  return decode_layers(hidden, layers, num_layers, step, head, logits);
}
int dp_decode_step_f32(float* hidden, const LayerArgs* layers, int64_t num_layers, const StepArgs* step,
                       const HeadArgs* head, float* logits) {
  return decode_layers(hidden, layers, num_layers, step, head, logits);
}

}  // extern "C"
