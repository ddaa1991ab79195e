// The weight seam of the CPU kernels: every linear layer of the decode path goes through one
// function (linear_any in cpu_kernels.cpp) that takes a WeightDesc. F32 and BF16 are handled
// by cpu_kernels.cpp itself; every other format by quant_gemv.h when that header exists
// (see dualpace/model/KERNELS.md for its contract). Format ids are GGML's type ids, so a GGUF
// tensor's type can be passed as is.

#pragma once

#include <cstdint>

enum WeightFormat : int32_t {
  DP_W_F32 = 0,
  DP_W_F16 = 1,
  DP_W_Q4_0 = 2,
  DP_W_Q4_1 = 3,
  DP_W_Q8_0 = 8,
  DP_W_Q4_K = 12,
  DP_W_Q6_K = 14,
  DP_W_BF16 = 30,
};

// A weight matrix W [N, K] (y = x W^T): row n starts at data + n * row_bytes. For block formats
// a row holds K / block_elems blocks back to back (K a multiple of the block size).
struct WeightDesc {
  int32_t format;  // a WeightFormat
  int32_t reserved;
  const void* data;
  int64_t N, K;
  int64_t row_bytes;
};
