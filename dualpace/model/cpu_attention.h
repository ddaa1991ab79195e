// Decode attention over paged KV (one query token per sequence), read in place: per (sequence,
// context split) task, whole blocks (all kv heads) streamed once with paced software prefetch;
// per kv head, scores for all query heads of the group, an online softmax, and p @ V; splits
// are merged with their max and sum.
//
// Written against `vf` (cpu_simd.h): fp32 K/V on every variant, and bf16 K/V widened to fp32
// in registers, with probabilities rounded to bf16 as the reference does. The avx512_bf16
// variant takes bf16 K/V through the vdpbf16ps pieces of cpu_bf16dot.h instead ("lanes").

#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_bf16dot.h"
#include "cpu_simd.h"

namespace dp {

#if defined(DP_ISA_BF16DOT)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif
// bf16 K/V through the vdpbf16ps pieces (token pairs, scores with tokens in lanes)
template <typename T>
constexpr bool kLanes = sizeof(T) == 2 && kBf16Dot;

constexpr int64_t PARALLEL_MIN_MACS = 1 << 18;

struct AttnShape {
  int64_t block_size, num_kv_heads, group, head_dim;
  // elements between one token's rows in a block; 0: num_kv_heads * head_dim. A call over some of
  // the kv heads (the caches and q offset to the first) sets it to the cache's full row.
  int64_t row_stride = 0;
};

// partial dot products (16 lanes, to be summed) of one key row with one query head; ND = D / 16
template <int ND, typename T>
inline vf partial_dot(const float* q, const T* k) {
  vf acc = vmul(vload(q), vload(k));
  for (int j = 1; j < ND; ++j) acc = vfma(vload(q + 16 * j), vload(k + 16 * j), acc);
  return acc;
}

// p @ V over one chunk of n <= 16 tokens (rows `stride` elements apart), query heads
// [g0, g0 + NG), accumulated into acc (float32 [group, D], element order).
template <int ND, int NG, typename T>
__attribute__((always_inline)) inline void pv_chunk(const T* v, int64_t stride, int64_t n, const float* probs,
                                                    int64_t ld, int64_t g0, float* acc_mem) {
  vf acc[NG][ND];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < ND; ++j) acc[g][j] = vload(acc_mem + ((g0 + g) * ND + j) * 16);
  for (int64_t i = 0; i < n; ++i) {
    vf vv[ND];
    for (int j = 0; j < ND; ++j) vv[j] = vload(v + i * stride + 16 * j);
    for (int g = 0; g < NG; ++g) {
      const vf p = vset1(probs[(g0 + g) * ld + i]);
      for (int j = 0; j < ND; ++j) acc[g][j] = vfma(p, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < ND; ++j) vstore(acc_mem + ((g0 + g) * ND + j) * 16, acc[g][j]);
}

// Stores probabilities as float, rounded like the cache type (the reference casts them to the
// value dtype before p @ V), and returns the stored values.
template <typename T>
inline vf store_probs(float* dst, vf p, const T* like) {
  const vf r = round_like(p, like);
  vstore(dst, r);
  return r;
}

// Scores of query heads [g0, g0 + NG) against one chunk of n <= 16 key rows (`stride` apart):
// scores[g * ld + i] = scale * q_g . k_i, lanes past n set to -inf. Each key row is loaded once
// for the NG heads; one vsum16 per head turns the 16 partial vectors into 16 scores.
template <int ND, int NG, typename T>
__attribute__((always_inline)) inline void chunk_scores(const float* q, int64_t D, const T* k, int64_t stride,
                                                        int64_t n, int64_t g0, float* parts, vf vscale, float* scores,
                                                        int64_t ld) {
  for (int64_t i = 0; i < n; ++i, k += stride)
    for (int g = 0; g < NG; ++g) vstore(parts + (g * 16 + i) * 16, partial_dot<ND>(q + (g0 + g) * D, k));
  for (int g = 0; g < NG; ++g) {
    for (int64_t i = n; i < 16; ++i) vstore(parts + (g * 16 + i) * 16, vzero());
    const vf sc = vmul(vsum16(parts + g * 256), vscale);
    vstore(scores + (g0 + g) * ld, vkeep_first(sc, n, -INFINITY));
  }
}

// Software prefetch of a task's later blocks, paced: a few cache lines of K and V per call, one
// call after each 16-token chunk of scores and of p @ V, so that the lines of the next window
// arrive while this one is computed. (Prefetching a whole block at once, 192 lines for SmolLM2,
// filled the load queue and the miss buffers in a burst and stalled the computation behind it:
// the kernel then read DRAM at ~11 GB/s per thread where a plain read of the same blocks
// reaches 20-28.)
struct KVPrefetcher {
  const char *k_cache, *v_cache;
  const int64_t* table;
  int64_t block_bytes, row_bytes, block_size, len, blk, blk_end, off, bytes;
  const char *k, *v;

  void seek(int64_t b) {
    blk = b;
    off = 0;
    if (blk >= blk_end) {
      k = v = nullptr;
      return;
    }
    k = k_cache + table[blk] * block_bytes;
    v = v_cache + table[blk] * block_bytes;
    bytes = std::min(block_size, len - blk * block_size) * row_bytes;
  }
  inline void step(int64_t lines) {
    for (; lines > 0 && k; --lines) {
      prefetch(k + off);
      prefetch(v + off);
      off += 64;
      if (off >= bytes) seek(blk + 1);
    }
  }
};

// One window (up to WINDOW chunks of <= 16 tokens) of one kv head for all query heads of its
// group: scores (lanes: from q_perm, see chunk_scores_lanes; otherwise from the fp32 query qf),
// one online-softmax update per query head, p @ V. k/v chunk pointers point at the head's row in
// each chunk's first token. The state is updated: m [group], l [group][16] (per-lane partial
// sums of exp, reduced once at the end of the task) and acc [group][LANES][16].
template <typename T, int ND, int MAX_NG, int WINDOW>
__attribute__((always_inline)) inline void attn_window(const float* qf /* [group, D] */, const bf16* q_perm,
                                                       int64_t G, int64_t D, int64_t stride, vf vscale,
                                                       const T* const* chunk_k, const T* const* chunk_v,
                                                       const int64_t* chunk_n, int64_t n_chunks, float* m,
                                                       float* l /* [group][16] */, float* acc, KVPrefetcher& pf,
                                                       int64_t pf_lines) {
  constexpr int64_t LANES = kLanes<T> ? 2 * ND : ND;  // accumulator vectors per query head
  constexpr int64_t ld = WINDOW * 16;
  using P = std::conditional_t<kLanes<T>, bf16, float>;
  alignas(64) float scores[16 * WINDOW * 16];  // [group][window tokens]
  alignas(64) P probs[16 * WINDOW * 16];       // [group][window tokens]
#if defined(DP_ISA_BF16DOT)
  if constexpr (kLanes<T>) {
    alignas(64) float parts[16 * 4 * 16];  // [group][4 token groups][16 lanes]
    for (int64_t w = 0; w < n_chunks; ++w) {
      chunk_scores_lanes<ND>(q_perm, G, chunk_k[w], stride, chunk_n[w], vscale.v, scores + 16 * w, ld, parts);
      pf.step(pf_lines);
    }
  } else
#endif
  {
    alignas(64) float parts[4 * 16 * 16];  // [4 heads][16 tokens][16 lanes]
    for (int64_t w = 0; w < n_chunks; ++w) {
      const T* k = chunk_k[w];
      const int64_t n = chunk_n[w];
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: chunk_scores<ND, 4>(qf, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
          case 3: chunk_scores<ND, 3>(qf, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
          case 2: chunk_scores<ND, 2>(qf, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
          default: chunk_scores<ND, 1>(qf, D, k, stride, n, g0, parts, vscale, scores + 16 * w, ld); break;
        }
      }
      pf.step(pf_lines);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    vf vm = vset1(-INFINITY);
    for (int64_t w = 0; w < n_chunks; ++w) vm = vmax(vm, vload(scores + g * ld + 16 * w));
    const float m_new = std::max(m[g], vmaxr(vm));
    vm = vset1(m_new);
    vf vsum_p = vzero();
    for (int64_t w = 0; w < n_chunks; ++w) {
      const vf p = vkeep_first(vexp(vsub(vload(scores + g * ld + 16 * w), vm)), chunk_n[w], 0.0f);
      // probabilities rounded as in the reference; the sum counts the rounded values
#if defined(DP_ISA_BF16DOT)
      if constexpr (kLanes<T>) vsum_p = vadd(vsum_p, vf{store_probs(probs + g * ld + 16 * w, p.v)}); else
#endif
      vsum_p = vadd(vsum_p, store_probs(reinterpret_cast<float*>(probs) + g * ld + 16 * w, p, chunk_k[w]));
    }
    vf lv = vload(l + 16 * g);  // per-lane partial sums of exp
    if (m_new != m[g]) {
      const vf vfac = vset1(std::exp(m[g] - m_new));  // 0 on the first window (m = -inf)
      lv = vmul(lv, vfac);
      for (int64_t j = 0; j < LANES; ++j) {
        float* a = acc + (g * LANES + j) * 16;
        vstore(a, vmul(vload(a), vfac));
      }
      m[g] = m_new;
    }
    vstore(l + 16 * g, vadd(lv, vsum_p));
  }
  for (int64_t w = 0; w < n_chunks; ++w) {
    const T* v = chunk_v[w];
    const P* pw = probs + 16 * w;
    const int64_t n = chunk_n[w];
    for (int64_t g0 = 0; g0 < G; g0 += MAX_NG) {
      const int64_t ng = std::min<int64_t>(MAX_NG, G - g0);
#if defined(DP_ISA_BF16DOT)
      if constexpr (kLanes<T>) {
        switch (ng) {
          case 4: pv_chunk_pairs<ND, (MAX_NG >= 4 ? 4 : 1)>(v, stride, n, pw, ld, g0, acc); break;
          case 3: pv_chunk_pairs<ND, (MAX_NG >= 3 ? 3 : 1)>(v, stride, n, pw, ld, g0, acc); break;
          case 2: pv_chunk_pairs<ND, (MAX_NG >= 2 ? 2 : 1)>(v, stride, n, pw, ld, g0, acc); break;
          default: pv_chunk_pairs<ND, 1>(v, stride, n, pw, ld, g0, acc); break;
        }
        continue;
      }
#endif
      const float* pf32 = reinterpret_cast<const float*>(pw);
      switch (ng) {
        case 4: pv_chunk<ND, (MAX_NG >= 4 ? 4 : 1)>(v, stride, n, pf32, ld, g0, acc); break;
        case 3: pv_chunk<ND, (MAX_NG >= 3 ? 3 : 1)>(v, stride, n, pf32, ld, g0, acc); break;
        case 2: pv_chunk<ND, (MAX_NG >= 2 ? 2 : 1)>(v, stride, n, pf32, ld, g0, acc); break;
        default: pv_chunk<ND, 1>(v, stride, n, pf32, ld, g0, acc); break;
      }
    }
    pf.step(pf_lines);
  }
}

// A 64-byte aligned float buffer: on the stack up to N floats, on the heap above.
template <int64_t N, typename E = float>
struct ScratchBuf {
  alignas(64) E local[N];
  std::vector<E> heap;
  E* get(int64_t n) {
    if (n <= N) return local;
    heap.resize(n + 64 / sizeof(E));
    return reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(heap.data()) + 63) & ~uintptr_t(63));
  }
};

// One task: blocks [blk0, blk1) of one sequence (context `len` tokens), all kv heads and all
// query heads of their groups, reading the blocks in place. The blocks are walked once, and each
// window of up to WINDOW chunks of <= 16 tokens is computed for every kv head in turn, so a task
// reads whole blocks (all heads' rows are adjacent in the cache) as one sequential stream
// instead of one head's rows spread over the block. Writes per query head the unnormalized
// output [D] (element order), the running max and the sum of exp.
template <typename T, int ND, int MAX_NG>
void attn_task(const T* q /* [kv heads, group, D] */, float scale, const T* k_cache, const T* v_cache,
               const int64_t* table, int64_t blk0, int64_t blk1, int64_t len, const AttnShape& s, float* m_out,
               float* l_out, float* out) {
  constexpr int WINDOW = 4;  // chunks
  const int64_t G = s.group, D = s.head_dim, stride = s.row_stride ? s.row_stride : s.num_kv_heads * D;
  constexpr int64_t LANES = kLanes<T> ? 2 * ND : ND;
  const int64_t num_q = s.num_kv_heads * G;  // query heads of this task
  ScratchBuf<32 * 8 * 16> acc_buf;
  float* acc = acc_buf.get(num_q * LANES * 16);
  std::fill(acc, acc + num_q * LANES * 16, 0.0f);
  ScratchBuf<64 * 17> ml_buf;  // l [query head][16 lanes] partial sums, then m [query head]
  float* l = ml_buf.get(17 * num_q);
  float* m = l + 16 * num_q;
  for (int64_t g = 0; g < num_q; ++g) m[g] = -INFINITY;
  std::fill(l, l + 16 * num_q, 0.0f);
  const vf vscale = vset1(scale);
  ScratchBuf<kLanes<T> ? 32 * 4 * 4 * 32 : 1, bf16> q_perm_buf;
  bf16* q_perm = nullptr;
  ScratchBuf<sizeof(T) == 2 && !kLanes<T> ? 32 * 128 : 1> qf_buf;
  const float* qf = nullptr;
#if defined(DP_ISA_BF16DOT)
  if constexpr (kLanes<T>) {
    q_perm = q_perm_buf.get(num_q * ND * 4 * 32);
    permute_query<ND>(q, num_q, q_perm);
  }
#endif
  if constexpr (sizeof(T) == 4) {
    qf = q;
  } else if constexpr (!kLanes<T>) {
    float* conv = qf_buf.get(num_q * D);
    for (int64_t i = 0; i < num_q * D; ++i) conv[i] = bf2f(q[i]);
    qf = conv;
  }
  const T* chunk_k[WINDOW];
  const T* chunk_v[WINDOW];
  int64_t chunk_n[WINDOW];
  int num_chunks = 0;

  // The prefetcher starts one window after the first and is kept between one and three windows
  // ahead of the window being computed. Per call (2 per chunk and kv head) it issues as many
  // lines of K and of V as the computation consumes: chunk tokens * D * sizeof(T) / 128, i.e.
  // one window's worth per window. (Measured on Zen 4, 1 thread: 0.75x that pace 16.5 GB/s, 1x
  // 21.5, 1.25x 19.7, 2x 15.1; a faster pace bursts again, a slower one falls behind.)
  const int64_t window_blocks = std::max<int64_t>(1, WINDOW * 16 / s.block_size);
  KVPrefetcher pf{reinterpret_cast<const char*>(k_cache), reinterpret_cast<const char*>(v_cache), table,
                  s.block_size * stride * static_cast<int64_t>(sizeof(T)), stride * static_cast<int64_t>(sizeof(T)),
                  s.block_size, len, 0, blk1, 0, 0, nullptr, nullptr};
  pf.seek(blk0 + window_blocks);
  const int64_t pf_lines =
      std::max<int64_t>(1, std::min<int64_t>(16, s.block_size) * D * static_cast<int64_t>(sizeof(T)) / 128);
  int64_t pf_lines_now = pf_lines;

  auto run_window = [&]() {
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      const T* hk[WINDOW];
      const T* hv[WINDOW];
      for (int w = 0; w < num_chunks; ++w) {
        hk[w] = chunk_k[w] + h * D;
        hv[w] = chunk_v[w] + h * D;
      }
      const int64_t i = h * G;
      attn_window<T, ND, MAX_NG, WINDOW>(qf ? qf + i * D : nullptr, q_perm ? q_perm + i * ND * 4 * 32 : nullptr, G, D,
                                         stride, vscale, hk, hv, chunk_n, num_chunks, m + i, l + 16 * i,
                                         acc + i * LANES * 16, pf, pf_lines_now);
    }
    num_chunks = 0;
  };

  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int64_t base = table[blk] * s.block_size * stride;
    const int64_t n_block = std::min(s.block_size, len - blk * s.block_size);
    for (int64_t c = 0; c < n_block; c += 16) {
      chunk_k[num_chunks] = k_cache + base + c * stride;
      chunk_v[num_chunks] = v_cache + base + c * stride;
      chunk_n[num_chunks] = std::min<int64_t>(16, n_block - c);
      if (++num_chunks == WINDOW) {
        if (pf.blk <= blk) pf.seek(blk + 1);  // fell behind
        pf_lines_now = pf.blk > blk + 3 * window_blocks ? 0 : pf_lines;  // far enough ahead
        run_window();
      }
    }
  }
  if (num_chunks) run_window();
  for (int64_t g = 0; g < num_q; ++g) {
    m_out[g] = m[g];
    l_out[g] = vsum(vload(l + 16 * g));
#if defined(DP_ISA_BF16DOT)
    if constexpr (kLanes<T>) {
      unpermute_pairs(acc + g * LANES * 16, D, out + g * D);
      continue;
    }
#endif
    std::memcpy(out + g * D, acc + g * LANES * 16, D * sizeof(float));
  }
}

// Returns 0, or -2 when a context length or block id is out of range (nothing computed).
template <typename T, int ND, int MAX_NG>
int decode_attention(const T* q, int64_t ldq, const T* k_cache, const T* v_cache, int64_t num_blocks,
                     const int64_t* tables, int64_t ld_tables, const int64_t* context_lens, int64_t B,
                     const AttnShape& s, float scale, T* out, int64_t ld_out) {
  const int64_t KVH = s.num_kv_heads, G = s.group, D = s.head_dim, NQ = KVH * G;
  if (G > 16) return -1;
  const int threads = omp_get_max_threads();
  int64_t max_blocks = 0, total_blocks = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = (context_lens[b] + s.block_size - 1) / s.block_size;
    if (context_lens[b] < 1 || nb > ld_tables) return -2;
    for (int64_t i = 0; i < nb; ++i)
      if (tables[b * ld_tables + i] < 0 || tables[b * ld_tables + i] >= num_blocks) return -2;
    max_blocks = std::max(max_blocks, nb);
    total_blocks += nb;
  }
  // Tasks are (sequence, context split), each over all kv heads: a task streams whole blocks.
  // Long contexts are split (at block boundaries) so that there are about TASKS_PER_THREAD
  // tasks per thread (a thread slowed by another tenant hands work to the other); the splits
  // are merged with their max and sum below. A split covers at least MIN_SPLIT_TOKENS.
  constexpr int64_t TASKS_PER_THREAD = 8;
  constexpr int64_t MIN_SPLIT_TOKENS = 256;
  int64_t splits = 1;
  if (B < TASKS_PER_THREAD * threads)
    splits = std::max<int64_t>(1, std::min<int64_t>({(TASKS_PER_THREAD * threads + B - 1) / B,
                                                     max_blocks * s.block_size / MIN_SPLIT_TOKENS, max_blocks, 64}));
  const int64_t num_tasks = B * splits;
  std::vector<float> m(num_tasks * NQ), l(num_tasks * NQ), acc(num_tasks * NQ * D);
#pragma omp parallel for schedule(dynamic, 1) if (total_blocks * s.block_size * NQ * D >= PARALLEL_MIN_MACS)
  for (int64_t task = 0; task < num_tasks; ++task) {
    const int64_t b = task / splits;
    const int64_t split = task % splits;
    const int64_t len = context_lens[b];
    const int64_t nb = (len + s.block_size - 1) / s.block_size;
    const int64_t per_split = (nb + splits - 1) / splits;
    const int64_t blk0 = std::min(nb, split * per_split), blk1 = std::min(nb, blk0 + per_split);
    attn_task<T, ND, MAX_NG>(q + b * ldq, scale, k_cache, v_cache, tables + b * ld_tables, blk0, blk1, len, s,
                             m.data() + task * NQ, l.data() + task * NQ, acc.data() + task * NQ * D);
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < NQ; ++g) {
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, m[(b * splits + sp) * NQ + g]);
      float weights[64];
      float total = 0.0f;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t t = b * splits + sp;
        weights[sp] = l[t * NQ + g] > 0.0f ? std::exp(m[t * NQ + g] - mx) : 0.0f;
        total += weights[sp] * l[t * NQ + g];
      }
      T* dst = out + b * ld_out + g * D;
      for (int64_t d = 0; d < D; ++d) {
        float v = 0.0f;
        for (int64_t sp = 0; sp < splits; ++sp) v += weights[sp] * acc[((b * splits + sp) * NQ + g) * D + d];
        dst[d] = from_f32(v / total, dst);
      }
    }
  }
  return 0;
}

// Calls f(integral_constant<ND>, integral_constant<MAX_NG>) for head_dim D and cache type T, or
// returns -1 for a head_dim without kernels. ND: vectors per head row (D / 32 for the lanes
// path, D / 16 otherwise); MAX_NG: query heads per p @ V pass, sized to the register file.
template <typename T, typename F>
int with_head_dim(int64_t D, F&& f) {
  using std::integral_constant;
  if constexpr (kLanes<T>) {
    switch (D) {
      case 32: return f(integral_constant<int, 1>{}, integral_constant<int, 4>{});
      case 64: return f(integral_constant<int, 2>{}, integral_constant<int, 4>{});
      case 128: return f(integral_constant<int, 4>{}, integral_constant<int, 2>{});
      default: return -1;  // (cpu_fused_decode.py BF16_PAIRS_HEAD_DIMS)
    }
  } else {
#if defined(DP_ISA_AVX512)
    constexpr int NG[4] = {4, 4, 3, 1};  // 32 zmm registers
#else
    constexpr int NG[4] = {4, 2, 1, 1};  // 16 ymm registers, two per vf
#endif
    switch (D) {
      case 16: return f(integral_constant<int, 1>{}, integral_constant<int, NG[0]>{});
      case 32: return f(integral_constant<int, 2>{}, integral_constant<int, NG[1]>{});
      case 64: return f(integral_constant<int, 4>{}, integral_constant<int, NG[2]>{});
      case 128: return f(integral_constant<int, 8>{}, integral_constant<int, NG[3]>{});
      default: return -1;  // (cpu_fused_decode.py HEAD_DIMS)
    }
  }
}

}  // namespace dp
