// The routed experts of one mixture-of-experts layer in one call (dualpace/model/cpu_moe.py):
// included at the end of cpu_kernels.cpp, whose linear pieces (dense_rows, quant_rows through
// dp_quant::prepare / rows, silu_mul, widen_rows, chunk_rows) it runs in one parallel region.
//
// Why: run per expert, a decode step at batch 32 of a 128-expert top-8 model makes ~112 x 2
// linear calls per layer, each its own parallel region, plus torch's gathers and index adds; an
// expert with one row leaves a thread idle at each join. Here a step's (row, choice) pairs are
// grouped by expert (a counting sort, rows ascending within an expert) and the layer runs as the
// stages of run_stages (cpu_step_stages.h):
//   0  per selected expert: its rows of x gathered (and widened to fp32 for bf16), the gate/up
//      matrix's activations prepared (dp_quant::prepare: the activation mode in force decides,
//      per expert, from its own number of rows, as linear_any does for a call of that many rows);
//   1  gate/up in chunks of W rows, every selected expert's chunks one pool of tasks;
//   2  per selected expert: SiLU(gate) * up, the down matrix's activations prepared;
//   3  down in chunks of W rows, likewise;
//   4  per chunk of rows of x: the weighted sum of the row's experts' outputs, in ascending expert
//      order (transformers' loop order, and dualpace.model.moe's).
// Unselected experts are never read. Each product and the rounding of every intermediate to the
// compute dtype are those of the per-expert path (Kernels.linear per matrix, Kernels.silu_mul,
// then y * weight and the index add in the compute dtype), so the result is bitwise that path's
// where linear_any would take the same tiles (not on AMX tiles, which the grouped call leaves to
// dense bf16 x bf16 calls of its own).

#pragma once

struct MoeExpertsArgs {
  int64_t num_experts;
  int64_t hidden;        // H: gate/up's K and down's N
  int64_t intermediate;  // I: gate/up has 2 I rows (gate, then up), down's K
  const WeightDesc* gate_up;  // [num_experts]
  const WeightDesc* down;     // [num_experts]
};

namespace {

constexpr int64_t MOE_MAX_TOP_K = 64;  // choices per row (a row's pair slots are sorted on the stack)

// The experts' matrices have the shapes the layer names, in formats this build runs.
bool moe_experts_supported(const MoeExpertsArgs& a) {
  for (int64_t e = 0; e < a.num_experts; ++e) {
    const WeightDesc &gu = a.gate_up[e], &dn = a.down[e];
    if (!staged_format(gu) || !staged_format(dn) || gu.N != 2 * a.intermediate || gu.K != a.hidden ||
        dn.N != a.hidden || dn.K != a.intermediate)
      return false;
#if DP_HAS_QUANT
    for (const WeightDesc* w : {&gu, &dn})
      if (!is_dense(*w) && w->K % dp_quant::group_elems(w->format) != 0) return false;
#endif
  }
  return true;
}

// dst [H] = the sum over a row's k pair slots, in ascending slot order (= ascending expert id), of
// weight * y[slot], each product rounded to T before its add, as the per-expert path's two torch
// ops (a multiply, then index_add_) round: hence no FMA contraction here.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void weighted_sum(const T* y, int64_t H, const int64_t* row_slots,
                                                               int64_t k, const int64_t* pair_of, const T* weights,
                                                               T* dst) {
  int64_t slots[MOE_MAX_TOP_K];
  std::copy(row_slots, row_slots + k, slots);
  std::sort(slots, slots + k);
  for (int64_t h = 0; h < H; h += 16) {
    const int64_t left = H - h;
    vf acc = vzero();
    for (int64_t c = 0; c < k; ++c) {
      const vf product = round_like(vmul(vload(y + slots[c] * H + h, left), vset1(to_f32(weights[pair_of[slots[c]]]))), dst);
      acc = round_like(vadd(acc, product), dst);
    }
    vstore(dst + h, acc, left);
  }
}

// out [M, H] = sum over each row's k choices of weight * down(SiLU(gate x) * up x), x [M, H]
// rows ldx apart, expert_ids / weights [M, k] (k <= MOE_MAX_TOP_K). Returns 0; -1 for a shape or
// format the build cannot run; -2 for an expert id out of range (both found before anything is computed).
template <typename T>
int moe_experts(const T* x, int64_t M, int64_t ldx, const int64_t* expert_ids, const T* weights, int64_t k,
                const MoeExpertsArgs& a, T* out) {
  const int64_t E = a.num_experts, H = a.hidden, I = a.intermediate, P = M * k;
  if (k < 1 || k > MOE_MAX_TOP_K || !moe_experts_supported(a)) return -1;
  for (int64_t p = 0; p < P; ++p)
    if (expert_ids[p] < 0 || expert_ids[p] >= E) return -2;
  if (M == 0) return 0;
  // The pairs grouped by expert: pair_of[first[e] .. first[e + 1]) are expert e's, rows ascending.
  std::vector<int64_t> first(E + 1, 0), pair_of(P), slot_of(P);
  for (int64_t p = 0; p < P; ++p) ++first[expert_ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t slot = fill[expert_ids[p]]++;
      pair_of[slot] = p;
      slot_of[p] = slot;
    }
  }
  std::vector<int64_t> selected;
  for (int64_t e = 0; e < E; ++e)
    if (first[e + 1] > first[e]) selected.push_back(e);
  const int64_t S = static_cast<int64_t>(selected.size());
  const int threads = omp_get_max_threads();
  // Tasks: stage 0 and 2 one per selected expert; 1 and 3 every expert's W row chunks; 4 row chunks.
  std::vector<int64_t> gu_chunk(S), dn_chunk(S), gu_task0(S + 1, 0), dn_task0(S + 1, 0), prep_at(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t e = selected[s], rows = first[e + 1] - first[e];
    gu_chunk[s] = chunk_rows(rows, 2 * I, threads);
    dn_chunk[s] = chunk_rows(rows, H, threads);
    gu_task0[s + 1] = gu_task0[s] + (2 * I + gu_chunk[s] - 1) / gu_chunk[s];
    dn_task0[s + 1] = dn_task0[s] + (H + dn_chunk[s] - 1) / dn_chunk[s];
    int64_t bytes = 0;
#if DP_HAS_QUANT
    for (const WeightDesc* w : {&a.gate_up[e], &a.down[e]})
      if (!is_dense(*w)) bytes = std::max(bytes, dp_quant::prepare_bytes(*w, rows));
#endif
    prep_at[s + 1] = prep_at[s] + (bytes + 63) / 64 * 64;  // one expert's prepared activations, reused by down
  }
  constexpr int64_t ROWS_PER_SUM_TASK = 4;
  const std::vector<int64_t> begin = {0, S, S + gu_task0[S], 2 * S + gu_task0[S], 2 * S + gu_task0[S] + dn_task0[S],
                                      2 * S + gu_task0[S] + dn_task0[S] + (M + ROWS_PER_SUM_TASK - 1) / ROWS_PER_SUM_TASK};
  // Per pair slot: x gathered (T, and fp32 for bf16), gate/up out, SiLU * up (T, and fp32), down out.
  constexpr bool WIDEN = sizeof(T) == 2;
  const int64_t widest = std::max(H, I);
  thread_local std::vector<T> xt_buf, gu_buf, act_buf, y_buf;
  thread_local std::vector<float> xf_buf;
  thread_local std::vector<char> prep_buf;
  auto at_least = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  };
  T* const xt = at_least(xt_buf, P * H);
  T* const gu = at_least(gu_buf, P * 2 * I);
  T* const act = at_least(act_buf, P * I);
  T* const y = at_least(y_buf, P * H);
  float* const xf = WIDEN ? at_least(xf_buf, P * widest) : nullptr;
  char* const prep = at_least(prep_buf, std::max<int64_t>(prep_at[S], 1));
  const T* none = nullptr;
  // The expert of a chunk task: the last s with task0[s] <= task.
  auto expert_of_task = [S](const std::vector<int64_t>& task0, int64_t task) {
    return static_cast<int64_t>(std::upper_bound(task0.begin(), task0.begin() + S + 1, task) - task0.begin()) - 1;
  };
  // in [rows, K] (T, K apart) of expert s against W rows [n0, n1), through ep.
  auto chunk = [&](int64_t s, const T* in, const WeightDesc& w, int64_t n0, int64_t n1, const Epilogue<T>& ep) {
    const int64_t e = selected[s], rows = first[e + 1] - first[e];
    const float* in_f = WIDEN ? xf + first[e] * widest : reinterpret_cast<const float*>(in);
    const int64_t ldf = WIDEN ? widest : w.K;
    if (is_dense(w)) {
      dense_rows(in, w.K, in_f, ldf, rows, w, n0, n1, ep);
      return;
    }
#if DP_HAS_QUANT
    quant_rows(w, in_f, rows, ldf, prep + prep_at[s], n0, n1, ep);
#endif
  };
  auto prepare = [&](int64_t s, const T* in, const WeightDesc& w) {
    const int64_t e = selected[s], rows = first[e + 1] - first[e];
    if (WIDEN) {
      float* in_f = xf + first[e] * widest;
      for (int64_t r = 0; r < rows; ++r) widen_rows(in + r * w.K, 1, w.K, w.K, in_f + r * widest);
    }
#if DP_HAS_QUANT
    if (!is_dense(w))
      prepare_activations(w, WIDEN ? xf + first[e] * widest : reinterpret_cast<const float*>(in), rows,
                          WIDEN ? widest : w.K, prep + prep_at[s]);
#endif
  };
  run_stages(begin, [&](int64_t stage, int64_t task) {
    switch (stage) {
      case 0: {
        const int64_t e = selected[task];
        for (int64_t slot = first[e]; slot < first[e + 1]; ++slot)
          std::memcpy(xt + slot * H, x + (pair_of[slot] / k) * ldx, H * sizeof(T));
        prepare(task, xt + first[e] * H, a.gate_up[e]);
        break;
      }
      case 1: {
        const int64_t s = expert_of_task(gu_task0, task), e = selected[s];
        const int64_t n0 = (task - gu_task0[s]) * gu_chunk[s], n1 = std::min(2 * I, n0 + gu_chunk[s]);
        chunk(s, xt + first[e] * H, a.gate_up[e], n0, n1, Epilogue<T>{none, none, 0, gu + first[e] * 2 * I, 2 * I, 0});
        break;
      }
      case 2: {
        const int64_t e = selected[task], rows = first[e + 1] - first[e];
        silu_mul(gu + first[e] * 2 * I, rows, I, act + first[e] * I);
        prepare(task, act + first[e] * I, a.down[e]);
        break;
      }
      case 3: {
        const int64_t s = expert_of_task(dn_task0, task), e = selected[s];
        const int64_t n0 = (task - dn_task0[s]) * dn_chunk[s], n1 = std::min(H, n0 + dn_chunk[s]);
        chunk(s, act + first[e] * I, a.down[e], n0, n1, Epilogue<T>{none, none, 0, y + first[e] * H, H, 0});
        break;
      }
      default:
        for (int64_t m = task * ROWS_PER_SUM_TASK; m < std::min(M, (task + 1) * ROWS_PER_SUM_TASK); ++m)
          weighted_sum(y, H, slot_of.data() + m * k, k, pair_of.data(), weights, out + m * H);
    }
  });
  return 0;
}

}  // namespace

extern "C" {

// The routed experts of one MoE layer (moe_experts above): out [M, H] in x's type. Returns 0,
// -1 for a shape or weight format this build cannot run, -2 for an expert id out of range.
int dp_moe_experts_bf16(const bf16* x, int64_t M, int64_t ldx, const int64_t* expert_ids, const bf16* weights,
                        int64_t k, const MoeExpertsArgs* experts, bf16* out) {
  return moe_experts(x, M, ldx, expert_ids, weights, k, *experts, out);
}
int dp_moe_experts_f32(const float* x, int64_t M, int64_t ldx, const int64_t* expert_ids, const float* weights,
                       int64_t k, const MoeExpertsArgs* experts, float* out) {
  return moe_experts(x, M, ldx, expert_ids, weights, k, *experts, out);
}

}  // extern "C"
