// A mixture-of-experts layer on the CPU kernels (dualpace/model/cpu_moe.py): the routing of a
// step's rows, and their routed experts as stages of one parallel region. Included by
// cpu_kernels.cpp after the linear pieces it runs (dense_rows, quant_rows through dp_quant::prepare
// / rows, silu_mul, widen_rows, chunk_rows) and before the decode step, whose MoE layers run these
// same stages inside the step's own region (decode_layers_staged).
//
// Why: run per expert, a decode step at batch 32 of a 128-expert top-8 model makes ~112 x 2
// linear calls per layer, each its own parallel region, plus torch's gathers and index adds; an
// expert with one row leaves a thread idle at each join. Here a step's (row, choice) pairs are
// grouped by expert (a counting sort, rows ascending within an expert: ExpertGroups::group) and
// the layer runs as the stages of run_stages (cpu_step_stages.h):
//   0  per selected expert: its rows of x gathered (and widened to fp32 for bf16), the gate/up
//      matrix's activations prepared (dp_quant::prepare: the activation mode in force decides,
//      per expert, from its own number of rows, as linear_any does for a call of that many rows);
//   1  gate/up in chunks of W rows, every selected expert's chunks one pool of tasks;
//   2  per selected expert: SiLU(gate) * up, the down matrix's activations prepared;
//   3  down in chunks of W rows, likewise;
//   4  per chunk of rows of x: the weighted sum of the row's experts' outputs, in ascending expert
//      order (transformers' loop order, and dualpace.model.moe's), plus the residual where given.
// Unselected experts are never read. Each product and the rounding of every intermediate to the
// compute dtype are those of the per-expert path (Kernels.linear per matrix, Kernels.silu_mul,
// then y * weight and the index add in the compute dtype), so the result is bitwise that path's
// where linear_any would take the same tiles (not on AMX tiles, which the grouped call leaves to
// dense bf16 x bf16 calls of its own). The decode step counts its stages before the routing is
// known: it gives stages 0-3 the most tasks a step of M rows can need (max_selected, max_chunks),
// and a task past the step's own count does nothing.

#pragma once

struct MoeExpertsArgs {
  int64_t num_experts;
  int64_t hidden;        // H: gate/up's K and down's N
  int64_t intermediate;  // I: gate/up has 2 I rows (gate, then up), down's K
  const WeightDesc* gate_up;  // [num_experts]
  const WeightDesc* down;     // [num_experts]
};

namespace {

constexpr int64_t MOE_MAX_TOP_K = 64;         // choices per row (a row's choices are sorted on the stack)
constexpr int64_t MOE_ROWS_PER_SUM_TASK = 4;  // rows of x per task of the weighted sum

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

// The routing of M rows (dualpace.model.moe.route's arithmetic): per row of router logits [M, E]
// (T), softmax over the E experts in fp32, the k most probable (descending; of equal
// probabilities the lower expert first), with `norm` divided by their sum (summed in that order);
// ids [M, k], weights [M, k] rounded to T.
template <typename T>
void route_rows(const T* logits, int64_t M, int64_t E, int64_t k, bool norm, int64_t* ids, T* weights) {
  std::vector<float> probs(E);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = logits + m * E;
    float top = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) top = std::max(top, to_f32(row[e]));
    for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(to_f32(row[e]) - top);
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    int64_t* id = ids + m * k;
    float chosen[MOE_MAX_TOP_K];
    int64_t n = 0;  // insertion into the sorted choices so far: strictly greater moves ahead
    for (int64_t e = 0; e < E; ++e) {
      if (n == k && !(probs[e] > chosen[k - 1])) continue;
      int64_t at = std::min(n, k - 1);
      while (at > 0 && probs[e] > chosen[at - 1]) {
        chosen[at] = chosen[at - 1], id[at] = id[at - 1];
        --at;
      }
      chosen[at] = probs[e], id[at] = e;
      n = std::min(n + 1, k);
    }
    float total = 0.0f;
    for (int64_t c = 0; c < k; ++c) total += chosen[c];
    for (int64_t c = 0; c < k; ++c) weights[m * k + c] = from_f32(norm ? chosen[c] / total : chosen[c], weights);
  }
}

// dst [H] = (residual +) the sum over a row's k pair slots, in ascending slot order (= ascending
// expert id), of weight * y[slot], each product rounded to T before its add, as the per-expert
// path's torch ops (a multiply, then index_add_, then the residual's add) round: hence no FMA
// contraction here. residual may be dst itself.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void weighted_sum(const T* y, int64_t H, const int64_t* row_slots,
                                                               int64_t k, const int64_t* pair_of, const T* weights,
                                                               const T* residual, T* dst) {
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
    if (residual != nullptr) acc = round_like(vadd(vload(residual + h, left), acc), dst);
    vstore(dst + h, acc, left);
  }
}

// One MoE layer's step: the (row, choice) pairs grouped by expert (group), then the stages of the
// header's comment as methods taking the stage's task number; a task past the step's count of its
// stage does nothing, and a chunk stage given fewer tasks than chunks runs them strided.
template <typename T>
class ExpertGroups {
 public:
  // The most selected experts, and W row chunks of their N-row matrices, a step of M rows with k
  // choices each can have: chunk_rows gives an expert of up to SMALL_M rows `few` chunks and one of
  // more `many`, and at most M k / (SMALL_M + 1) experts have more.
  static int64_t max_selected(const MoeExpertsArgs& a, int64_t M, int64_t k) { return std::min(a.num_experts, M * k); }
  static int64_t max_chunks(const MoeExpertsArgs& a, int64_t N, int64_t M, int64_t k, int threads) {
    const int64_t most = max_selected(a, M, k), busy = std::min(most, M * k / (SMALL_M + 1));
    const int64_t few = (N + chunk_rows(1, N, threads) - 1) / chunk_rows(1, N, threads);
    const int64_t many = (N + chunk_rows(M, N, threads) - 1) / chunk_rows(M, N, threads);
    return most * few + busy * std::max<int64_t>(0, many - few);
  }

  // Groups expert_ids [M, k] (checked by the caller) by expert and sizes the stages and buffers.
  void group(const MoeExpertsArgs& a, const int64_t* expert_ids, int64_t M, int64_t k, int threads) {
    a_ = &a, M_ = M, k_ = k;
    const int64_t E = a.num_experts, H = a.hidden, I = a.intermediate, P = M * k;
    first_.assign(E + 1, 0);
    pair_of_.resize(P), slot_of_.resize(P);
    for (int64_t p = 0; p < P; ++p) ++first_[expert_ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) first_[e + 1] += first_[e];
    fill_.assign(first_.begin(), first_.end() - 1);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t slot = fill_[expert_ids[p]]++;
      pair_of_[slot] = p;
      slot_of_[p] = slot;
    }
    selected_.clear();
    for (int64_t e = 0; e < E; ++e)
      if (first_[e + 1] > first_[e]) selected_.push_back(e);
    const int64_t S = static_cast<int64_t>(selected_.size());
    gu_chunk_.resize(S), dn_chunk_.resize(S), gu_task0_.assign(S + 1, 0), dn_task0_.assign(S + 1, 0);
    prep_at_.assign(S + 1, 0);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t e = selected_[s], rows = first_[e + 1] - first_[e];
      gu_chunk_[s] = chunk_rows(rows, 2 * I, threads);
      dn_chunk_[s] = chunk_rows(rows, H, threads);
      gu_task0_[s + 1] = gu_task0_[s] + (2 * I + gu_chunk_[s] - 1) / gu_chunk_[s];
      dn_task0_[s + 1] = dn_task0_[s] + (H + dn_chunk_[s] - 1) / dn_chunk_[s];
      int64_t bytes = 0;
#if DP_HAS_QUANT
      for (const WeightDesc* w : {&a.gate_up[e], &a.down[e]})
        if (!is_dense(*w)) bytes = std::max(bytes, dp_quant::prepare_bytes(*w, rows));
#endif
      prep_at_[s + 1] = prep_at_[s] + (bytes + 63) / 64 * 64;  // one expert's prepared activations, reused by down
    }
    // Per pair slot: x gathered (T, and fp32 for bf16), gate/up out, SiLU * up (T, and fp32), down out.
    // Grown only: an object kept between calls (thread_local) neither frees nor zero-fills them again.
    widest_ = std::max(H, I);
    grow(xt_, P * H), grow(gu_, P * 2 * I), grow(act_, P * I), grow(y_, P * H);
    if (WIDEN) grow(xf_, P * widest_);
    grow(prep_, std::max<int64_t>(prep_at_[S], 1));
  }

  int64_t selected() const { return static_cast<int64_t>(selected_.size()); }
  int64_t gate_up_tasks() const { return gu_task0_.back(); }
  int64_t down_tasks() const { return dn_task0_.back(); }

  // Stage 0: selected expert s's rows of x [M, H] (ldx apart), its gate/up activations prepared.
  void gather(int64_t s, const T* x, int64_t ldx) {
    if (s >= selected()) return;
    const int64_t e = selected_[s], H = a_->hidden;
    for (int64_t slot = first_[e]; slot < first_[e + 1]; ++slot)
      std::memcpy(xt_.data() + slot * H, x + (pair_of_[slot] / k_) * ldx, H * sizeof(T));
    prepare(s, xt_.data() + first_[e] * H, a_->gate_up[e]);
  }
  // Stage 1: gate/up chunks task, task + stride, ... (stride: the stage's number of tasks).
  void gate_up(int64_t task, int64_t stride) {
    for (; task < gate_up_tasks(); task += stride) {
      const int64_t s = expert_of(gu_task0_, task), e = selected_[s], I = a_->intermediate;
      const int64_t n0 = (task - gu_task0_[s]) * gu_chunk_[s], n1 = std::min(2 * I, n0 + gu_chunk_[s]);
      chunk(s, xt_.data() + first_[e] * a_->hidden, a_->gate_up[e], n0, n1, gu_.data() + first_[e] * 2 * I, 2 * I);
    }
  }
  // Stage 2: expert s's SiLU(gate) * up, its down activations prepared.
  void activate(int64_t s) {
    if (s >= selected()) return;
    const int64_t e = selected_[s], rows = first_[e + 1] - first_[e], I = a_->intermediate;
    silu_mul(gu_.data() + first_[e] * 2 * I, rows, I, act_.data() + first_[e] * I);
    prepare(s, act_.data() + first_[e] * I, a_->down[e]);
  }
  // Stage 3: down chunks task, task + stride, ..., likewise.
  void down(int64_t task, int64_t stride) {
    for (; task < down_tasks(); task += stride) {
      const int64_t s = expert_of(dn_task0_, task), e = selected_[s], H = a_->hidden;
      const int64_t n0 = (task - dn_task0_[s]) * dn_chunk_[s], n1 = std::min(H, n0 + dn_chunk_[s]);
      chunk(s, act_.data() + first_[e] * a_->intermediate, a_->down[e], n0, n1, y_.data() + first_[e] * H, H);
    }
  }
  // Stage 4: rows [task * MOE_ROWS_PER_SUM_TASK, ...) of out [M, H] (ldo apart): (residual +) the
  // weighted sum of each row's experts, weights [M, k] in route order.
  void sum_rows(int64_t task, const T* weights, const T* residual, T* out, int64_t ldo) const {
    const int64_t H = a_->hidden;
    for (int64_t m = task * MOE_ROWS_PER_SUM_TASK; m < std::min(M_, (task + 1) * MOE_ROWS_PER_SUM_TASK); ++m)
      weighted_sum(y_.data(), H, slot_of_.data() + m * k_, k_, pair_of_.data(), weights,
                   residual == nullptr ? nullptr : residual + m * ldo, out + m * ldo);
  }
  static int64_t sum_tasks(int64_t M) { return (M + MOE_ROWS_PER_SUM_TASK - 1) / MOE_ROWS_PER_SUM_TASK; }

 private:
  static constexpr bool WIDEN = sizeof(T) == 2;

  template <typename V>
  static void grow(std::vector<V>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
  // The selected expert of a chunk task: the last s with task0[s] <= task.
  int64_t expert_of(const std::vector<int64_t>& task0, int64_t task) const {
    return static_cast<int64_t>(std::upper_bound(task0.begin(), task0.end(), task) - task0.begin()) - 1;
  }
  const float* fp32_of(int64_t s, const T* in) const {
    return WIDEN ? xf_.data() + first_[selected_[s]] * widest_ : reinterpret_cast<const float*>(in);
  }
  void prepare(int64_t s, const T* in, const WeightDesc& w) {
    const int64_t rows = first_[selected_[s] + 1] - first_[selected_[s]];
    if (WIDEN) {
      float* in_f = xf_.data() + first_[selected_[s]] * widest_;
      for (int64_t r = 0; r < rows; ++r) widen_rows(in + r * w.K, 1, w.K, w.K, in_f + r * widest_);
    }
#if DP_HAS_QUANT
    if (!is_dense(w)) prepare_activations(w, fp32_of(s, in), rows, WIDEN ? widest_ : w.K, prep_.data() + prep_at_[s]);
#endif
  }
  // in [rows, K] (T, K apart) of selected expert s against W rows [n0, n1) into out (ldo apart).
  void chunk(int64_t s, const T* in, const WeightDesc& w, int64_t n0, int64_t n1, T* out, int64_t ldo) const {
    const int64_t rows = first_[selected_[s] + 1] - first_[selected_[s]];
    const int64_t ldf = WIDEN ? widest_ : w.K;
    const T* none = nullptr;
    const Epilogue<T> ep{none, none, 0, out, ldo, 0};
    if (is_dense(w)) {
      dense_rows(in, w.K, fp32_of(s, in), ldf, rows, w, n0, n1, ep);
      return;
    }
#if DP_HAS_QUANT
    quant_rows(w, fp32_of(s, in), rows, ldf, prep_.data() + prep_at_[s], n0, n1, ep);
#endif
  }

  const MoeExpertsArgs* a_ = nullptr;
  int64_t M_ = 0, k_ = 0, widest_ = 0;
  // The pairs grouped by expert: pair_of_[first_[e] .. first_[e + 1]) are expert e's, rows ascending.
  std::vector<int64_t> first_, fill_, pair_of_, slot_of_, selected_, gu_chunk_, dn_chunk_, gu_task0_, dn_task0_,
      prep_at_;
  std::vector<T> xt_, gu_, act_, y_;
  std::vector<float> xf_;
  std::vector<char> prep_;
};

// Whether k and every id of expert_ids [M, k] are in range: 0; -1 for k; -2 for an id.
int check_expert_ids(const MoeExpertsArgs& a, const int64_t* expert_ids, int64_t M, int64_t k) {
  if (k < 1 || k > MOE_MAX_TOP_K) return -1;
  for (int64_t p = 0; p < M * k; ++p)
    if (expert_ids[p] < 0 || expert_ids[p] >= a.num_experts) return -2;
  return 0;
}

// out [M, H] = (residual +) sum over each row's k choices of weight * down(SiLU(gate x) * up x),
// x [M, H] rows ldx apart, expert_ids / weights [M, k] (k <= MOE_MAX_TOP_K), residual and out H
// apart (residual may be out). Returns 0; -1 for a shape or format the build cannot run; -2 for an
// expert id out of range (both found before anything is computed).
template <typename T>
int moe_experts(const T* x, int64_t M, int64_t ldx, const int64_t* expert_ids, const T* weights, int64_t k,
                const MoeExpertsArgs& a, const T* residual, T* out) {
  if (!moe_experts_supported(a)) return -1;
  if (const int status = check_expert_ids(a, expert_ids, M, k); status != 0) return status;
  if (M == 0) return 0;
  thread_local ExpertGroups<T> kept;  // its buffers kept between this thread's calls
  ExpertGroups<T>& groups = kept;     // the region's threads use this one (not a thread_local of their own)
  groups.group(a, expert_ids, M, k, omp_get_max_threads());
  const int64_t S = groups.selected(), gu = groups.gate_up_tasks(), dn = groups.down_tasks();
  const std::vector<int64_t> begin = {0, S, S + gu, 2 * S + gu, 2 * S + gu + dn,
                                      2 * S + gu + dn + ExpertGroups<T>::sum_tasks(M)};
  run_stages(begin, [&](int64_t stage, int64_t task) {
    switch (stage) {
      case 0: groups.gather(task, x, ldx); break;
      case 1: groups.gate_up(task, gu); break;
      case 2: groups.activate(task); break;
      case 3: groups.down(task, dn); break;
      default: groups.sum_rows(task, weights, residual, out, a.hidden);
    }
  });
  return 0;
}

}  // namespace

extern "C" {

// The routed experts of one MoE layer (moe_experts above, no residual): out [M, H] in x's type.
// Returns 0, -1 for a shape or weight format this build cannot run, -2 for an expert id out of range.
int dp_moe_experts_bf16(const bf16* x, int64_t M, int64_t ldx, const int64_t* expert_ids, const bf16* weights,
                        int64_t k, const MoeExpertsArgs* experts, bf16* out) {
  return moe_experts<bf16>(x, M, ldx, expert_ids, weights, k, *experts, nullptr, out);
}
int dp_moe_experts_f32(const float* x, int64_t M, int64_t ldx, const int64_t* expert_ids, const float* weights,
                       int64_t k, const MoeExpertsArgs* experts, float* out) {
  return moe_experts<float>(x, M, ldx, expert_ids, weights, k, *experts, nullptr, out);
}

// The routing of M rows (route_rows above): router logits [M, E] in the activations' type ->
// expert ids [M, k] int64 and weights [M, k]. Returns 0; -1 for k outside 1..min(E, 64).
int dp_moe_route_bf16(const bf16* logits, int64_t M, int64_t E, int64_t k, int norm, int64_t* ids, bf16* weights) {
  if (k < 1 || k > std::min(E, MOE_MAX_TOP_K)) return -1;
  route_rows(logits, M, E, k, norm != 0, ids, weights);
  return 0;
}
int dp_moe_route_f32(const float* logits, int64_t M, int64_t E, int64_t k, int norm, int64_t* ids, float* weights) {
  if (k < 1 || k > std::min(E, MOE_MAX_TOP_K)) return -1;
  route_rows(logits, M, E, k, norm != 0, ids, weights);
  return 0;
}

}  // extern "C"
