// extern "C" entry points over quant_gemv.h, for the per-stage path (dualpace/model/quant.py):
// one linear call on a block-quantized weight (threads over output rows with OpenMP, sharing
// torch's runtime as cpu_kernels.cpp does) and the dequantization of chosen rows (embedding
// lookup of a quantized token_embd). Built by dualpace/model/quant_kernels.py.

#include <omp.h>

#include <cstdint>
#include <vector>

#include "kernel_weights.h"
#include "quant_gemv.h"

namespace {
constexpr int64_t ROWS_PER_TASK = 16;  // output rows per task: small enough to balance 2..64 threads
}

extern "C" {

int dp_quant_has_avx2() {
#if defined(__AVX2__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#else
  return 0;
#endif
}

// 512 when the build has quant_gemv_avx512.h's 512-bit fp32 tiles, 256 on AVX2, 0 on the plain
// C++ path.
int dp_quant_vector_bits() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}

// Rows of x from which the int16 mode computes with fp32 activations (AVX-512 builds); 0: never.
int64_t dp_quant_fp32_min_rows() {
  const int64_t rows = dp_quant::fp32_min_rows();
  return rows == INT64_MAX ? 0 : rows;
}

// Rows of x from which the int8 mode computes in int8 (builds with AVX-512 VNNI); 0: never.
int64_t dp_quant_int8_min_rows() {
#if defined(DP_QUANT_VNNI)
  return dp_quant::VNNI_MIN_ROWS;
#else
  return 0;
#endif
}

// Rows of x up to which the int8 mode rounds K-quant calls per super-block (quant_gemv_q8k.h); 0: never.
int64_t dp_quant_int8_k_max_rows() {
#if defined(DP_QUANT_VNNI)
  return dp_quant::Q8K_MAX_ROWS;
#else
  return 0;
#endif
}

// Rows of x up to which the int8 mode rounds Q8_0 / Q4_0 calls per block of 32 (quant_gemv_block_pairs.h); 0: never.
int64_t dp_quant_int8_pairs_max_rows() {
#if defined(DP_QUANT_VNNI)
  return dp_quant::PAIRS_MAX_ROWS;
#else
  return 0;
#endif
}

// max |x| / rms(x) above which an int8 row also gets its residual's lane (quant_gemv_vnni.h); 0: no int8 rows.
float dp_quant_int8_outlier_ratio() {
#if defined(DP_QUANT_VNNI)
  return dp_quant::VNNI_OUTLIER_RATIO;
#else
  return 0.0f;
#endif
}

int dp_quant_format_supported(int32_t format) { return dp_quant::supported(format) ? 1 : 0; }

// The activation arithmetic of later calls (quant_gemv.h: 0 fp32, 1 int16, 2 int8;
// another value leaves it as it is); returns the mode in force. Not to be called while a linear call runs.
int32_t dp_quant_set_activations(int32_t mode) { return dp_quant::set_activation_mode(mode); }

// y [M, N] (row stride ldy, fp32) = x [M, K] (row stride ldx, fp32) W^T. Returns -1 when the
// format is not supported or K is not a multiple of its block size.
int dp_quant_linear(const WeightDesc* w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) {
  if (!dp_quant::supported(w->format) || w->K % dp_quant::group_elems(w->format) != 0) return -1;
  std::vector<uint8_t> prepared(static_cast<size_t>(dp_quant::prepare_bytes(*w, M)));
  dp_quant::prepare(*w, x, M, ldx, prepared.data());
  const int64_t num_tasks = (w->N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  const bool parallel = w->N * w->K * M >= (1 << 16) && omp_get_max_threads() > 1;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < num_tasks; ++t) {
    const int64_t n0 = t * ROWS_PER_TASK, n1 = std::min(w->N, n0 + ROWS_PER_TASK);
    dp_quant::rows(*w, x, M, ldx, prepared.data(), n0, n1, y + n0, ldy);
  }
  return 0;
}

// out [rows, K] = rows [row0, row0 + rows) of W dequantized to fp32, threads over rows.
int dp_quant_dequantize_range(const WeightDesc* w, int64_t row0, int64_t rows, float* out) {
  if (!dp_quant::supported(w->format) || w->K % dp_quant::group_elems(w->format) != 0) return -1;
  if (row0 < 0 || rows < 0 || row0 + rows > w->N) return -2;
#pragma omp parallel for schedule(static) if (rows * w->K >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    dp_quant::dequantize_row(w->format, static_cast<const uint8_t*>(w->data) + (row0 + r) * w->row_bytes, w->K,
                             out + r * w->K);
  return 0;
}

// out [num_ids, K] = rows ids of W, dequantized to fp32. Returns -2 for an id outside [0, N).
int dp_quant_dequantize_rows(const WeightDesc* w, const int64_t* ids, int64_t num_ids, float* out) {
  if (!dp_quant::supported(w->format) || w->K % dp_quant::group_elems(w->format) != 0) return -1;
  for (int64_t i = 0; i < num_ids; ++i) {
    if (ids[i] < 0 || ids[i] >= w->N) return -2;
    dp_quant::dequantize_row(w->format, static_cast<const uint8_t*>(w->data) + ids[i] * w->row_bytes, w->K,
                             out + i * w->K);
  }
  return 0;
}
}
