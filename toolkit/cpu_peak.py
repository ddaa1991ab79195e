"""This CPU's peak for the instructions the CPU kernels multiply with, measured on it: a loop of
independent vpdpbusd (int8 x int8 into int32: AVX-512 VNNI, 512 and 256 bits), vfmadd231ps (fp32
FMA, 512 bits) and vdpbf16ps (bf16 pairs into fp32, 512 bits), 12 accumulators each (more than
latency x throughput), timed per thread count; the best of --repeats runs. Results are multiply-
adds per second (a MAC is two of the "ops" vendors count).

    python -m toolkit.cpu_peak --threads 1,2

Instructions the CPU or the compiler lacks are skipped (reported as null). Used beside
bench.cpu_decode to state the share of peak a batched step reaches.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dualpace.model import cpu_kernels_build as kbuild

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

template <class Body>
double run(int threads, long iters, Body body) {
  auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  body(iters);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define REPEAT12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// name(n, sink): n iterations of 12 independent OP(c_i, a, b); the sums go to *sink (kept live).
#define PEAK_LOOP(NAME, TARGET, VEC, A, B, INIT, OP, SUM)                 \
  __attribute__((target(TARGET))) void NAME(long n, int* sink) {          \
    VEC a = A, b = B;                                                     \
    VEC c[12];                                                            \
    for (int i = 0; i < 12; ++i) c[i] = INIT;                             \
    for (long i = 0; i < n; ++i) {                                        \
      _Pragma("GCC unroll 12") for (int j = 0; j < 12; ++j) c[j] = OP;    \
      __asm__ volatile("" : "+v"(a));                                     \
    }                                                                     \
    float s = 0;                                                          \
    for (int i = 0; i < 12; ++i) s += SUM;                                \
    *sink = (int)s;                                                       \
  }

PEAK_LOOP(dpbusd512, "avx512f,avx512vnni", __m512i, _mm512_set1_epi8(1), _mm512_set1_epi8(2), _mm512_set1_epi32(1),
          _mm512_dpbusd_epi32(c[j], a, b), (float)_mm512_reduce_add_epi32(c[i]))
PEAK_LOOP(dpbusd256, "avx512f,avx512vl,avx512vnni", __m256i, _mm256_set1_epi8(1), _mm256_set1_epi8(2),
          _mm256_set1_epi32(1), _mm256_dpbusd_epi32(c[j], a, b), (float)_mm256_extract_epi32(c[i], 0))
PEAK_LOOP(fma512, "avx512f", __m512, _mm512_set1_ps(1.0001f), _mm512_set1_ps(0.9999f), _mm512_set1_ps(1.0f),
          _mm512_fmadd_ps(a, b, c[j]), _mm512_reduce_add_ps(c[i]))
PEAK_LOOP(dpbf16, "avx512f,avx512bf16", __m512bh, (__m512bh)_mm512_set1_epi16(0x3f80),
          (__m512bh)_mm512_set1_epi16(0x3f80), (__m512bh)_mm512_setzero_si512(),
          (__m512bh)_mm512_dpbf16_ps((__m512)c[j], a, b), _mm512_reduce_add_ps((__m512)c[i]))

int main(int argc, char** argv) {
  const char* what = argv[1];
  int threads = atoi(argv[2]);
  long iters = atol(argv[3]);
  static int sinks[64 * 16];
  void (*fn)(long, int*) = nullptr;
  double macs_per_iter = 0;
  if (!strcmp(what, "vpdpbusd512")) { fn = dpbusd512; macs_per_iter = 12 * 64; }
  if (!strcmp(what, "vpdpbusd256")) { fn = dpbusd256; macs_per_iter = 12 * 32; }
  if (!strcmp(what, "vfmadd512")) { fn = fma512; macs_per_iter = 12 * 16; }
  if (!strcmp(what, "vdpbf16ps512")) { fn = dpbf16; macs_per_iter = 12 * 32; }
  double s = run(threads, iters, [&](long n) { fn(n, &sinks[16 * omp_get_thread_num()]); });
  printf("%.6e\n", macs_per_iter * iters * threads / s);
  return 0;
}
"""

# instruction -> the /proc/cpuinfo flags it needs
INSTRUCTIONS = {
    "vpdpbusd512": ("avx512f", "avx512_vnni"),
    "vpdpbusd256": ("avx512f", "avx512vl", "avx512_vnni"),
    "vfmadd512": ("avx512f",),
    "vdpbf16ps512": ("avx512f", "avx512_bf16"),
}


def build(folder: Path) -> Path:
    src, exe = folder / "peak.cpp", folder / "peak"
    src.write_text(SOURCE)
    subprocess.run(["g++", "-O2", "-fopenmp", "-std=c++17", "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    return exe


def measure(exe: Path, instruction: str, threads: int, iters: int, repeats: int) -> float:
    best = 0.0
    for _ in range(repeats):
        out = subprocess.run([str(exe), instruction, str(threads), str(iters)], check=True, capture_output=True,
                             text=True).stdout
        best = max(best, float(out))
    return best


def peaks(threads: list[int], iters: int = 20_000_000, repeats: int = 3) -> dict:
    """{instruction: {threads: MAC/s}} for the instructions this CPU has (others: None)."""
    flags = kbuild.cpu_flags()
    with tempfile.TemporaryDirectory() as folder:
        exe = build(Path(folder))
        return {name: ({t: measure(exe, name, t, iters, repeats) for t in threads}
                       if all(f in flags for f in needs) else None)
                for name, needs in INSTRUCTIONS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--iters", type=int, default=20_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = peaks([int(t) for t in args.threads.split(",")], args.iters, args.repeats)
    for name, per_threads in result.items():
        cells = "skipped (not on this CPU)" if per_threads is None else "  ".join(
            f"{t} thread(s) {v / 1e9:7.1f} GMAC/s" for t, v in per_threads.items())
        print(f"{name:>14}: {cells}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
