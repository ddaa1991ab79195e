// AMX-BF16 tiles for bf16 x bf16 products of several rows of x (compiled only into the
// avx512_bf16 variant; run only where the CPU has amx_tile + amx_bf16 and the kernel granted this
// process the tile data state, see amx_permitted). The functions that touch tiles carry
// target("amx-tile,amx-bf16"), so the variant's own flags stay those of the table in KERNELS.md.
//
// One product y = x W^T, W [N, K] bf16 row-major (K % 32 == 0), x [M, K] bf16:
//   A tile = 16 rows of W x 32 bf16, loaded straight from the matrix (stride = the row's bytes);
//   B tile = 32 elements of K of 16 rows of x, repacked once per call to pairs (VNNI layout:
//            16 rows of 16 x-rows x 2 bf16, rows of x past M are zero), amx_pack;
//   C tile = 16 W rows x 16 x rows, fp32. Four C tiles (32 W rows x 32 x rows) per block.

#pragma once

#include "cpu_simd.h"

#if defined(DP_ISA_BF16DOT) && defined(__x86_64__) && defined(__GNUC__)
#define DP_AMX_BUILT 1

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace dp {

// Whether this process may run AMX-BF16: cpuid leaf 7 says amx-tile and amx-bf16, and
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) succeeded (Linux >= 5.16; the permission
// is process-wide, oneDNN asks for it too). Asked once.
inline bool amx_permitted() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 22) & 1)) return false;  // AMX-TILE, AMX-BF16
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

inline std::atomic<int>& amx_enabled_flag() {
  static std::atomic<int> enabled{1};
  return enabled;
}

inline bool amx_on() { return amx_enabled_flag().load(std::memory_order_relaxed) != 0 && amx_permitted(); }

// bf16 elements of x packed as B tiles: per block of 16 rows of x and of 32 elements of K, 512.
inline int64_t amx_pack_elems(int64_t M, int64_t K) { return (M + 15) / 16 * (K / 32) * 512; }

// x [M, K] (ldx apart) -> out: block (mb, kb) at (mb * K / 32 + kb) * 512, its row kp holding
// x[16 mb + j][32 kb + 2 kp + {0, 1}] for j = 0..15 (zero past M).
inline void amx_pack(const bf16* x, int64_t M, int64_t ldx, int64_t K, bf16* out) {
  const int64_t num_mb = (M + 15) / 16, num_kb = K / 32;
  for (int64_t mb = 0; mb < num_mb; ++mb)
    for (int64_t kb = 0; kb < num_kb; ++kb) {
      uint32_t* t = reinterpret_cast<uint32_t*>(out + (mb * num_kb + kb) * 512);
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t m = 16 * mb + j;
        if (m >= M) {
          for (int kp = 0; kp < 16; ++kp) t[kp * 16 + j] = 0;
          continue;
        }
        uint32_t pairs[16];
        std::memcpy(pairs, x + m * ldx + 32 * kb, sizeof(pairs));
        for (int kp = 0; kp < 16; ++kp) t[kp * 16 + j] = pairs[kp];
      }
    }
}

struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (W sub-block 0/1 x x sub-block 0/1), 4-5: A (W sub-blocks), 6-7: B; all 16 x 64 B.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure() {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_release() { _tile_release(); }

#ifndef DP_AMX_PREFETCH
#define DP_AMX_PREFETCH 1
#endif

// C[16 NB W rows from n0][16 MB x rows from 16 mb0] = W x^T into c (fp32, [16 NB][16 MB]);
// while it runs, the next block's W rows (from n0 + 16 NB, up to n_prefetch_end) are prefetched,
// one line per row per step of K. amx_configure() must have run on this thread.
template <int NB, int MB>
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_block(const bf16* w, int64_t ldw, int64_t n0,
                                                                  int64_t n_prefetch_end, int64_t K,
                                                                  const bf16* xpack, int64_t mb0, float* c) {
  const int64_t num_kb = K / 32, stride_w = ldw * 2;
  const bf16* a0 = w + n0 * ldw;
  const bf16* a1 = a0 + 16 * ldw;
  const bf16* b0 = xpack + mb0 * num_kb * 512;
  const bf16* b1 = b0 + num_kb * 512;
  const int64_t next = n0 + 16 * NB, num_next = std::min<int64_t>(16 * NB, n_prefetch_end - next);
  _tile_zero(0);
  if (MB > 1) _tile_zero(1);
  if (NB > 1) _tile_zero(2);
  if (NB > 1 && MB > 1) _tile_zero(3);
  for (int64_t kb = 0; kb < num_kb; ++kb) {
    if (DP_AMX_PREFETCH)
      for (int64_t r = 0; r < num_next; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (next + r) * ldw + 32 * kb), _MM_HINT_T0);
    _tile_loadd(4, a0 + 32 * kb, stride_w);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (MB > 1) {
      _tile_loadd(7, b1 + kb * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (NB > 1) {
      _tile_loadd(5, a1 + 32 * kb, stride_w);
      _tile_dpbf16ps(2, 5, 6);
      if (MB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ldc = 16 * MB * 4;  // bytes
  _tile_stored(0, c, ldc);
  if (MB > 1) _tile_stored(1, c + 16, ldc);
  if (NB > 1) _tile_stored(2, c + 16 * 16 * MB, ldc);
  if (NB > 1 && MB > 1) _tile_stored(3, c + 16 * 16 * MB + 16, ldc);
}

}  // namespace dp

#endif  // DP_ISA_BF16DOT && x86-64
