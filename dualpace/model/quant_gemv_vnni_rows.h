// The int8 mode's loop over W rows and passes of x rows (quant_gemv_vnni.h's tiles). Included by
// quant_gemv.h after quant_gemv_vnni.h (namespace dp_quant).
//
// A call with more rows of x than one pass holds (VNNI_MAX_GROUPS lane groups) runs each tile of W
// rows once per pass. Decoding a block (Q4_K / Q6_K packed scales and nibbles, the -128 sums of
// the signed formats) then costs once per pass, so such calls stage each block of W rows once
// (StagedBlock: the bytes and the scales decoded) and run every pass over the staged copy; the
// arithmetic is the same, so the results are bitwise those of the unstaged tile.
#include <vector>

namespace dp_quant {

// Lane groups per pass: up to 64 rows of x share a pass over a tile of W rows (more rows run the
// tile again, from cache: W is read from memory once per call).
constexpr int VNNI_MAX_GROUPS = 4;
// W rows per tile: 8 (MV <= 2 groups: 8 x MV accumulators + 8 activation vectors fit the 32
// vector registers; Q8_0 at 2 groups spilled them), 4 beyond.
constexpr int VNNI_TILE_ROWS = 8;

// Lanes below M store their row of y; residual lanes (all after them, in this pass or a later one
// over the same W rows) add to their row's.
template <int32_t F, class V, int MV, bool STAGED>
inline void tile_vnni_store(const uint8_t* const* wrows, const WeightDesc& w, const uint8_t* act, int64_t g0,
                            const VnniHeader& head, const int32_t* targets, int64_t col, int64_t cols, float* y,
                            int64_t ldy) {
  constexpr int NR = MV <= (F == DP_W_Q8_0 ? 1 : 2) ? 8 : 4;  // Q8_0 at 2 groups: 4 (one_scale_rows)
  constexpr int L = V::L;
  const int64_t group_bytes = vnni_group_bytes(w.K, L, tile_offset_form<F, MV, STAGED>());
  for (int r0 = 0; r0 < VNNI_TILE_ROWS && r0 < cols; r0 += NR) {
    alignas(64) float out[NR][4 * 16];
    tile_vnni<F, V, NR, MV, STAGED>(wrows + r0, act + g0 * group_bytes, w.K, out, NR * w.row_bytes);
    for (int r = 0; r < NR && r0 + r < cols; ++r)
      for (int64_t i = 0; i < MV * L && g0 * L + i < head.num_lanes; ++i) {
        const int64_t v = g0 * L + i;
        if (v < head.num_rows) y[v * ldy + col + r0 + r] = out[r][i];
        else y[targets[v - head.num_rows] * ldy + col + r0 + r] += out[r][i];
      }
  }
}

// W rows per block of the loop over passes: a pass's activations (up to 64 rows, 1.25 bytes per
// element and row) and the block's W rows both stay in L2 while the other is swept. Staged (64
// bytes per block of 32 weights): as many rows, in tiles, as 256 KiB hold (64 at K = 2048).
constexpr int64_t VNNI_BLOCK_ROWS = 64;
inline int64_t vnni_staged_block_rows(int64_t K) {
  const int64_t rows = (256 * 1024) / (K / 32 * static_cast<int64_t>(sizeof(StagedBlock)));
  return std::max<int64_t>(VNNI_TILE_ROWS, std::min(VNNI_BLOCK_ROWS, rows / VNNI_TILE_ROWS * VNNI_TILE_ROWS));
}

// W rows r0..r1 staged into out, (r1 - r0) x K / 32 blocks.
template <int32_t F>
inline void stage_rows(const WeightDesc& w, int64_t r0, int64_t r1, StagedBlock* out) {
  using Spec = Fmt<F>;
  const int64_t num_groups = w.K / (32 * Spec::G);
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + n * w.row_bytes;
    for (int64_t grp = 0; grp < num_groups; ++grp, out += Spec::G) {
      const uint8_t* g = row + grp * Spec::BYTES;
      float dw[8], mw[8];
      group_scales<F>(g, dw, mw);
      for (int j = 0; j < Spec::G; ++j) stage<F, false>(g, j, dw, mw, out[j].bytes, &out[j].s);
    }
  }
}

template <int32_t F, class V, bool STAGED>
inline void rows_vnni_lanes(const WeightDesc& w, const uint8_t* prepared, int64_t n0, int64_t n1, float* y,
                            int64_t ldy) {
  const auto& head = *reinterpret_cast<const VnniHeader*>(prepared);
  const int32_t* targets = reinterpret_cast<const int32_t*>(prepared + sizeof(VnniHeader));
  const uint8_t* act = prepared + vnni_header_bytes(head.num_rows);
  const int64_t groups = vnni_groups(head.num_lanes), blocks_per_row = w.K / 32;
  const int64_t block_rows = STAGED ? vnni_staged_block_rows(w.K) : VNNI_BLOCK_ROWS;
  thread_local std::vector<StagedBlock> staged;  // kept between calls: no allocation per call
  if (STAGED && staged.size() < static_cast<size_t>(block_rows * blocks_per_row))
    staged.resize(block_rows * blocks_per_row);
  for (int64_t b0 = n0; b0 < n1; b0 += block_rows) {
    const int64_t b1 = std::min(n1, b0 + block_rows);
    if constexpr (STAGED) stage_rows<F>(w, b0, b1, staged.data());
    for (int64_t g0 = 0; g0 < groups; g0 += VNNI_MAX_GROUPS) {
      for (int64_t n = b0; n < b1; n += VNNI_TILE_ROWS) {
        const uint8_t* wrows[VNNI_TILE_ROWS];
        for (int r = 0; r < VNNI_TILE_ROWS; ++r) {
          const int64_t row = std::min(n + r, b1 - 1);  // past the last: any row (outputs dropped)
          wrows[r] = STAGED ? reinterpret_cast<const uint8_t*>(staged.data() + (row - b0) * blocks_per_row)
                            : static_cast<const uint8_t*>(w.data) + row * w.row_bytes;
        }
        const int64_t col = n - n0, cols = std::min<int64_t>(VNNI_TILE_ROWS, n1 - n);
        switch (std::min<int64_t>(VNNI_MAX_GROUPS, groups - g0)) {
          case 1: tile_vnni_store<F, V, 1, STAGED>(wrows, w, act, g0, head, targets, col, cols, y, ldy); break;
          case 2: tile_vnni_store<F, V, 2, STAGED>(wrows, w, act, g0, head, targets, col, cols, y, ldy); break;
          case 3: tile_vnni_store<F, V, 3, STAGED>(wrows, w, act, g0, head, targets, col, cols, y, ldy); break;
          default: tile_vnni_store<F, V, 4, STAGED>(wrows, w, act, g0, head, targets, col, cols, y, ldy); break;
        }
      }
    }
  }
}

// Rows of x from which the int8 mode runs these kernels (int16 below: the per-block work on each
// weight block, shared by the rows, is not paid back by fewer rows; measured on an Intel Xeon,
// AVX-512 VNNI: 0.94x of int16 at 4 rows of Q8_0, 1.28x at 5; Q4_K 0.68x at 4, 1.08x at 5).
constexpr int64_t VNNI_MIN_ROWS = 5;

// Rows of x from which a call stages its W rows: more than one pass.
constexpr int64_t VNNI_STAGED_MIN_LANES = 16 * VNNI_MAX_GROUPS + 1;

template <int32_t F>
inline void rows_vnni(const WeightDesc& w, const uint8_t* prepared, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int32_t lanes = reinterpret_cast<const VnniHeader*>(prepared)->num_lanes;
  if (vnni_lanes(lanes) == 8)
    rows_vnni_lanes<F, Lanes8, false>(w, prepared, n0, n1, y, ldy);
  else if (lanes < VNNI_STAGED_MIN_LANES)
    rows_vnni_lanes<F, Lanes16, false>(w, prepared, n0, n1, y, ldy);
  else
    rows_vnni_lanes<F, Lanes16, true>(w, prepared, n0, n1, y, ldy);
}

}  // namespace dp_quant
