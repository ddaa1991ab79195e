// A sequence of dependent stages run inside ONE OpenMP parallel region (the fused decode step,
// cpu_kernels.cpp's decode_layers_staged).
//
// Why: a decode step issued as one parallel region per operation forks and joins ~150 times,
// and every join waits for the slowest thread of the team, including one that another tenant
// has descheduled. Here the step's tasks are numbered in stage order
// and claimed with one shared counter; the next task is claimed only once every task of the
// earlier stages is done (a second counter of finished tasks reaching the first task number of
// its stage: no task of a stage can finish before all earlier ones, so the count can only reach
// it then). A thread that waits, or is descheduled while holding no task, delays nobody: the
// others claim the remaining tasks. The team is joined once, at the end of the step.

#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace dp {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins (pause) this many times waiting for a stage, then yields the core between checks (on a
// shared machine the thread that holds the awaited task may need it).
constexpr int STAGE_SPINS = 4096;

// stage_begin[s] = the first task number of stage s; stage_begin.back() = the number of tasks.
// run(s, i) runs task i of stage s; tasks of one stage must be independent of each other.
template <typename Run>
void run_stages(const std::vector<int64_t>& stage_begin, Run&& run) {
  const int64_t total = stage_begin.back();
  alignas(64) std::atomic<int64_t> next{0};  // claims and completions on separate cache lines
  alignas(64) std::atomic<int64_t> done{0};
#pragma omp parallel
  {
    size_t s = 0;
    int spins = 0;
    for (;;) {
      int64_t t = next.load(std::memory_order_acquire);
      if (t >= total) break;
      while (stage_begin[s + 1] <= t) ++s;  // `next` only grows
      // Wait before claiming: a thread that waits (or yields its core and is descheduled) holds
      // no task, so it delays nobody.
      if (done.load(std::memory_order_acquire) < stage_begin[s]) {
        if (++spins < STAGE_SPINS) spin_pause();
        else std::this_thread::yield();
        continue;
      }
      if (!next.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      spins = 0;
      run(static_cast<int64_t>(s), t - stage_begin[s]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
}

}  // namespace dp
