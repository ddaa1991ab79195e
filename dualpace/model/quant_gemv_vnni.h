// The int8 mode's rows for int8_lanes_min_rows() or more rows of x (quant_gemv.h) in builds with
// AVX-512 VNNI (the avx512_bf16 variant): int8 x int8 dot products with vpdpbusd, the activation
// rows in the vector lanes and each weight's 4-byte group broadcast from memory. Included by
// quant_gemv.h inside its AVX2 section (namespace dp_quant, after Fmt, group_scales, values and
// quant_gemv_i16.h's hmax8 and hsum8_epi32).
//
// Why this layout: with the weights in the lanes (one block per vector) every 32 weights x 1
// row cost a vpdpbusd and three float operations (convert, scale product, FMA): the float work
// bounds it. With the activation rows in the lanes (8 or 16 rows per vector, "a lane group"),
// a block of 32 weights of one W row costs 8 vpdpbusd per lane group (each multiplies 4 weight
// bytes, broadcast, with 4 bytes of each of 16 rows) and the same three float operations for all
// 16 rows, so the integer units do most of the work. The weights need no transposition (they are
// broadcast); the activations are transposed once per call by prepare.
//
// Arithmetic: activations quantized per row per 16 elements (x ~ dx q, q in [-127, 127], one
// scale per 16: llama.cpp's q8_0 has one per 32; per 16 halves the rounding error for one more
// convert and FMA per block, and brings the KL divergence below llama.cpp's, docs/perf.md).
// vpdpbusd multiplies unsigned by signed bytes. The nibbles 0..15 of Q4_0 / Q4_1 / Q4_K are its
// unsigned operand (broadcast) and the activations, stored as q, its signed one: the sum is
// dot(q, w) as it is. Q8_0's values are too up to two lane groups, as w + 128, each lane's sum
// starting at -128 sum(q) (offset_form). Beyond, Q8_0's values and Q6_K's q - 32 are the signed
// operand and the activations are stored as q + 128 (unsigned); each lane's sum is then
// dot(q, w) + 128 sum(w), and the accumulator starts at -128 sum(w) (per 16 weights, from vpsadbw).
// Either way the integer result is dot(q, w) exactly. Per 16 the float scale is dw dx, and the Q4
// formats add their min term mw (dx sum(q)) (Q4_0: mw = -8 dw). (The q + 128 form for the Q4
// formats too, with Q4_0 as q - 8, ran 0.77-0.91x of this at 8-64 rows of Q4_K, one thread of an
// Intel Xeon.)
// Exactness: the products of the rounded activations and the weights are exact integers; the
// result differs from the dequantized fp32 model by the activation rounding (<= dx / 2 per
// element), as llama.cpp's batched products do.

#pragma once

// (not standalone: quant_gemv.h includes it after the pieces it uses)
namespace dp_quant {

// Formats whose values are unsigned nibbles (Q4_0, Q4_1, Q4_K): they are vpdpbusd's unsigned
// operand and the activations its signed one (stored as q), so the integer sum is dot(q, w) as it
// is; Q4_0's -8 joins its min term (-8 dw sum(dx q)).
constexpr bool unsigned_weights(int32_t format) {
  return format == DP_W_Q4_0 || format == DP_W_Q4_1 || format == DP_W_Q4_K;
}

// Up to two lane groups (decode batches of 9-32 rows) Q8_0's values are the unsigned operand too, as
// w + 128 (staged with their bytes xored with 0x80), against the activations as q: each lane's sum
// is then dot(q, w) + 128 sum(q), and it starts at -128 sum(q), which prepare_vnni stores per lane
// and half block beside the scales and each lane group holds in registers for all the tile's W rows.
// The signed form (activations as q + 128, each sum starting at -128 sum(w) of its W row and half,
// broadcast from a general register per W row, half and lane group) ran 0.87-0.98x of that at 16
// rows and about the same at 32 (one thread of a Zen 4, 1B gate/up and down). From three lane
// groups, and in staged calls, Q8_0 keeps the signed form: the offset form's separate broadcasts of
// the weights (vpdpbusd's memory operand can only be its signed one) ran 0.65-0.9x there. The
// integer sums are the same either way, so the results too.
constexpr int64_t Q8_OFFSET_MAX_LANES = 32;
inline bool offset_form(int32_t format, int64_t lanes) { return format == DP_W_Q8_0 && lanes <= Q8_OFFSET_MAX_LANES; }
// The same for a tile of MV lane groups: a call that is not staged holds all its lanes in one pass
// (VNNI_STAGED_MIN_LANES, quant_gemv_vnni_rows.h), so MV <= 2 there means at most 32 lanes.
template <int32_t F, int MV, bool STAGED>
constexpr bool tile_offset_form() { return F == DP_W_Q8_0 && !STAGED && MV * 16 <= Q8_OFFSET_MAX_LANES; }

// acc + the dot products of the weight dword at w4 (unsigned: the nibble formats), broadcast, with
// each lane's 4 activation bytes (signed). The broadcast is in the same asm statement as its
// vpdpbusd so that the compiler cannot hoist it (one_scale_rows says why).
template <class I>
inline I dot_unsigned_weights(I acc, I a, const uint8_t* w4) {
  I w;
  asm("vpbroadcastd %3, %1\n\tvpdpbusd %2, %1, %0"
      : "+v"(acc), "=&v"(w)
      : "v"(a), "m"(*reinterpret_cast<const int32_t(*)[1]>(w4)));
  return acc;
}

// Vector types of a lane group: 16 activation rows (zmm) or 8 (ymm).
struct Lanes16 {
  static constexpr int L = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  // Signed weights (Q8_0, Q6_K): the dword is vpdpbusd's embedded-broadcast memory operand
  // (one_scale_rows says why); unsigned: dot_unsigned_weights.
  static I dot(I acc, I a, const uint8_t* w4) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t(*)[1]>(w4)));
    return acc;
  }
  static I dot_wu(I acc, I a, const uint8_t* w4) { return dot_unsigned_weights(acc, a, w4); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mulv(F a, F b) { return _mm512_mul_ps(a, b); }
  static F mul(F a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
  static F fma_s(F a, float b, F c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
struct Lanes8 {
  static constexpr int L = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I dot(I acc, I a, const uint8_t* w4) {
    asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t(*)[1]>(w4)));
    return acc;
  }
  static I dot_wu(I acc, I a, const uint8_t* w4) { return dot_unsigned_weights(acc, a, w4); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mulv(F a, F b) { return _mm256_mul_ps(a, b); }
  static F mul(F a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
  static F fma_s(F a, float b, F c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

// Lanes per group for M rows of x: 8 up to 8 rows, else 16.
inline int vnni_lanes(int64_t M) { return M <= 8 ? 8 : 16; }
inline int64_t vnni_groups(int64_t M) { return (M + vnni_lanes(M) - 1) / vnni_lanes(M); }

// Prepared layout, per lane group, per block b of 32: 8 x L dwords (dword j of every lane's
// block: its bytes 4j..4j+3 as q, or q + 128 against signed weights), then L floats dx of elements
// 0-15, L floats dx of 16-31, L floats sum(dx q) of the block (the min term), and in Q8_0's offset
// form L int32 -128 sum(q) of elements 0-15, then of 16-31 (the starts against its w + 128; the other
// layouts end before them: the activations are read again for every tile of W rows).
inline int64_t vnni_block_bytes(int L, bool offset) { return (offset ? 13 : 11) * 4 * L; }
inline int64_t vnni_group_bytes(int64_t K, int L, bool offset) { return (K / 32) * vnni_block_bytes(L, offset); }
// The most either layout takes for M lanes.
inline int64_t vnni_bytes(int64_t K, int64_t M) {
  const int L = vnni_lanes(M);
  return vnni_groups(M) * vnni_group_bytes(K, L, true);
}

// Two vectors of 8 int32 (each within int8) as 16 int8 in element order: packs work per 128-bit
// lane, the permute restores the order.
inline __m128i pack_i32_to_i8(__m256i r0, __m256i r1) {
  const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
}

// 16 floats of x as q = round(x * 127 / max|x|), int8 in element order, into *q8; returns the
// scale dx = max / 127 and sets *sum_q to sum(q).
inline float round16_i8(const float* x, __m128i* q8, int32_t* sum_q) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
  const float amax = hmax8(_mm256_max_ps(_mm256_andnot_ps(sign_bit, v0), _mm256_andnot_ps(sign_bit, v1)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256i r0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), ROUND));
  const __m256i r1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), ROUND));
  *q8 = pack_i32_to_i8(r0, r1);
  *sum_q = hsum8_epi32(_mm256_add_epi32(r0, r1));
  return amax / 127.0f;
}

// 16 floats of x as q = round(x * 127 / max|x|) (+ 128, as bytes) into dwords `q`, L lanes apart;
// returns the scale dx = max / 127, adds dx sum(q) to *sum and sets *start to -128 sum(q).
inline float quantize16(const float* x, uint8_t* q, int L, float* sum, int32_t* start, bool offset) {
  __m128i p8;
  int32_t sum_q;
  const float dx = round16_i8(x, &p8, &sum_q);
  *start = -128 * sum_q;
  alignas(16) uint32_t d[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(d), offset ? _mm_xor_si128(p8, _mm_set1_epi8(static_cast<char>(0x80))) : p8);
  for (int j = 0; j < 4; ++j) std::memcpy(q + 4 * j * L, &d[j], 4);
  *sum += dx * static_cast<float>(sum_q);
  return dx;
}

// Outlier rows: a row whose max |x| exceeds VNNI_OUTLIER_RATIO x its rms (a few channels far above
// the rest, as the special tokens of a chat prompt carry) is rounded twice: its int8 rounding
// x1 = dx q plus that rounding's residual x - x1, itself rounded to int8 per 16 elements (about
// int16's precision: error <= max / (254 x 254) per 16), each as a lane of its own whose products
// are added. Plain int8 of such rows flipped the default model's chat answer; so did a bound of
// 25 (in a torch emulation of the rounding), 20 held it with the exact mode's margin. Rows of
// plain text above 20: ~7% on the default model (bench/quant_kl.py's text), random weights ~0%.
constexpr float VNNI_OUTLIER_RATIO = 20.0f;

inline bool is_outlier_row(const float* x, int64_t K) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps(), sq = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v));
    sq = _mm256_fmadd_ps(v, v, sq);
  }
  const float m = hmax8(amax);
  return m * m * static_cast<float>(K) > VNNI_OUTLIER_RATIO * VNNI_OUTLIER_RATIO * hsum8(sq);
}

// Whether any of the M rows of x (row stride ldx) is an outlier row.
inline bool any_outlier_row(const float* x, int64_t M, int64_t ldx, int64_t K) {
  for (int64_t m = 0; m < M; ++m)
    if (is_outlier_row(x + m * ldx, K)) return true;
  return false;
}

// The residual of 16 floats of x after quantize16's rounding: x - dx q (one rounding: fma), into r.
inline void residual16(const float* x, float* r) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
  const float amax = hmax8(_mm256_max_ps(_mm256_andnot_ps(sign_bit, v0), _mm256_andnot_ps(sign_bit, v1)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), dx = _mm256_set1_ps(amax / 127.0f);
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm256_storeu_ps(r, _mm256_fnmadd_ps(_mm256_round_ps(_mm256_mul_ps(v0, inv), ROUND), dx, v0));
  _mm256_storeu_ps(r + 8, _mm256_fnmadd_ps(_mm256_round_ps(_mm256_mul_ps(v1, inv), ROUND), dx, v1));
}

// Header of the int8 mode's prepared activations: the lanes in use (the M rows of x, then one
// residual lane per outlier row) and, per residual lane, the row of x it adds to.
struct VnniHeader {
  int32_t num_lanes;
  int32_t num_rows;
};
inline int64_t vnni_header_bytes(int64_t M) { return (static_cast<int64_t>(sizeof(VnniHeader)) + 4 * M + 63) / 64 * 64; }
// Room for every row of x being an outlier (2M lanes).
inline int64_t vnni_prepared_bytes(int64_t K, int64_t M) { return vnni_header_bytes(M) + vnni_bytes(K, 2 * M); }

// Lane `lane` of block b of a lane group: row `src` of x quantized (residual: its residual's).
// signed_weights: the activations as q + 128; starts: the offset form's starts stored.
inline void quantize_lane(const float* src, bool residual, int64_t b, int L, int lane, bool signed_weights,
                          bool starts_stored, uint8_t* q) {
  float* dx = reinterpret_cast<float*>(q + 8 * 4 * L);
  int32_t* start = reinterpret_cast<int32_t*>(dx + 3 * L);
  alignas(32) float r[32];
  const float* v = src + 32 * b;
  if (residual) {
    residual16(v, r);
    residual16(v + 16, r + 16);
    v = r;
  }
  float sum = 0.0f;
  int32_t starts[2];
  dx[lane] = quantize16(v, q + 4 * lane, L, &sum, &starts[0], signed_weights);
  dx[L + lane] = quantize16(v + 16, q + 4 * (4 * L + lane), L, &sum, &starts[1], signed_weights);
  dx[2 * L + lane] = sum;
  if (starts_stored) start[lane] = starts[0], start[L + lane] = starts[1];
}

// The M rows of x into the layout above, outlier rows' residual lanes after them (lanes past the
// last: q = 0, dx = 0).
inline void prepare_vnni(const float* x, int64_t M, int64_t ldx, int64_t K, int32_t format, uint8_t* out) {
  auto* head = reinterpret_cast<VnniHeader*>(out);
  int32_t* targets = reinterpret_cast<int32_t*>(out + sizeof(VnniHeader));
  int64_t lanes = M;
  for (int64_t m = 0; m < M; ++m)
    if (is_outlier_row(x + m * ldx, K)) targets[lanes++ - M] = static_cast<int32_t>(m);
  head->num_lanes = static_cast<int32_t>(lanes);
  head->num_rows = static_cast<int32_t>(M);
  uint8_t* body = out + vnni_header_bytes(M);
  const int64_t nb = K / 32;
  const int L = vnni_lanes(lanes);
  const bool starts = offset_form(format, lanes), offset = !unsigned_weights(format) && !starts;
  for (int64_t g = 0; g < vnni_groups(lanes); ++g) {
    uint8_t* gout = body + g * vnni_group_bytes(K, L, starts);
    for (int lane = 0; lane < L; ++lane) {
      const int64_t v = g * L + lane;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* q = gout + b * vnni_block_bytes(L, starts);
        if (v >= lanes) {
          float* dx = reinterpret_cast<float*>(q + 8 * 4 * L);
          int32_t* start = reinterpret_cast<int32_t*>(dx + 3 * L);
          for (int j = 0; j < 8; ++j) std::memset(q + 4 * (j * L + lane), offset ? 0x80 : 0, 4);
          dx[lane] = dx[L + lane] = dx[2 * L + lane] = 0.0f;
          if (starts) start[lane] = start[L + lane] = 0;
          continue;
        }
        const int64_t row = v < M ? v : targets[v - M];
        quantize_lane(x + row * ldx, v >= M, b, L, lane, offset, starts, q);
      }
    }
  }
}

// One weight block of 32 as vpdpbusd takes it (written to `buf` unless the row's own bytes serve:
// Q8_0's signed form), the scale of each half of 16 (Q6_K: its own per-16 scales), the min, and
// for the signed values (Q6_K's q - 32, Q8_0's signed form) -128 x the sum of each half's.
struct Staged {
  const uint8_t* bytes;
  float dw[2];
  float mw;
  int32_t corr[2];
};

// -128 x the sum of the signed bytes of each half (16) of v, into corr[0], corr[1].
inline void neg128_sums(__m256i v, int32_t* corr) {
  const __m256i u = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
  const __m256i s = _mm256_sad_epu8(u, _mm256_setzero_si256());  // sums of 8 bytes: [a0 a1 | b0 b1]
  const __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
  const __m128i t = _mm_add_epi64(_mm_unpacklo_epi64(lo, hi), _mm_unpackhi_epi64(lo, hi));  // [a, b]
  corr[0] = -128 * (_mm_cvtsi128_si32(t) - 128 * 16);
  corr[1] = -128 * (_mm_extract_epi32(t, 2) - 128 * 16);
}

// Sub-block j of group g (a GGML block) staged (OFFSET: Q8_0's offset form).
template <int32_t F, bool OFFSET>
inline void stage(const uint8_t* g, int j, const float* dw, const float* mw, uint8_t* buf, Staged* s) {
  __m256i v;
  if constexpr (F == DP_W_Q8_0 && OFFSET) {  // w + 128
    v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 2)),
                         _mm256_set1_epi8(static_cast<char>(0x80)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), v);
    s->bytes = buf;
  } else if constexpr (F == DP_W_Q8_0) {
    v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 2));
    s->bytes = g + 2;
  } else {
    v = values<F>(g, j);  // Q4: nibbles 0..15; Q6_K: q - 32
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), v);
    s->bytes = buf;
  }
  if constexpr (!unsigned_weights(F) && !OFFSET) neg128_sums(v, s->corr);
  if constexpr (F == DP_W_Q6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(g + 192);
    s->dw[0] = dw[j] * static_cast<float>(sc[2 * j]);
    s->dw[1] = dw[j] * static_cast<float>(sc[2 * j + 1]);
  } else {
    s->dw[0] = s->dw[1] = dw[j];
  }
  s->mw = unsigned_weights(F) ? mw[j] : 0.0f;
}

// A block of 32 weights staged ahead of the tile (quant_gemv_vnni_rows.h): its Staged, whose
// bytes point at its own copy.
struct alignas(64) StagedBlock {
  Staged s;
  alignas(32) uint8_t bytes[32];
};

// One block of NR W rows of a format with one weight scale per block (Q8_0, Q4_0, Q4_K) against
// lane group mv (activations xa, scales dx, per-lane sum(dx q) at dxsum): acc[r][mv] +=
// dw (dx0 s0 + dx1 s1) [+ mw dxsum], s the integer sums of the two halves. Two forms matter on an
// AMD Zen 4 (vpdpbusd and the float multiplies share two pipes; convert runs beside them):
// - each weight dword is loaded by the vpdpbusd that uses it (Lanes16::dot / dot_wu, inline asm);
//   as _mm512_set1_epi32 the compiler hoisted each broadcast out of the lane-group loop, into 64
//   registers at 8 W rows, spilled and reloaded per block;
// - dw is applied once per block (1 multiply and 2 FMAs, not 2 and 2).
// One thread, 1B gate/up and down, old / new: Q8_0 at 9-32 rows 1.0-1.18x, 64: 1.32-1.35x,
// 128: 1.57-1.85x (Q8_0 with 4 W rows per tile at 2 lane groups, tile_vnni_store). The sum
// differs from the per-half order (tile_vnni's loop) by fp32 rounding. Q4_1 keeps that order: with
// dw once per block the default model's chat answer (a Q4_1 prompt in int8; a near tie, which a
// changed rounding of one activation in one layer can flip) stopped naming Paris.
// start: the offset form's starts of the two halves (L int32 each: -128 sum(q) per lane).
template <int32_t F, class V, int NR, int MV, bool OFFSET>
inline void one_scale_rows(const typename V::I* xa, const typename V::F* dx, const typename V::F& dxsum,
                           const int32_t* start, const Staged* st, typename V::F (*acc)[MV], int mv) {
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    typename V::I s0, s1;
    if constexpr (OFFSET) {
      s0 = V::load(start);
      s1 = V::load(start + V::L);
    } else if constexpr (unsigned_weights(F)) {
      s0 = s1 = V::set1(0);
    } else {
      s0 = V::set1(st[r].corr[0]);
      s1 = V::set1(st[r].corr[1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if constexpr (OFFSET || unsigned_weights(F)) {
        s0 = V::dot_wu(s0, xa[i], st[r].bytes + 4 * i);
        s1 = V::dot_wu(s1, xa[i + 4], st[r].bytes + 16 + 4 * i);
      } else {
        s0 = V::dot(s0, xa[i], st[r].bytes + 4 * i);
        s1 = V::dot(s1, xa[i + 4], st[r].bytes + 16 + 4 * i);
      }
    }
    const typename V::F t = V::fma(V::cvt(s1), dx[1], V::mulv(V::cvt(s0), dx[0]));
    acc[r][mv] = V::fma_s(t, st[r].dw[0], acc[r][mv]);
    if constexpr (unsigned_weights(F)) acc[r][mv] = V::fma_s(dxsum, st[r].mw, acc[r][mv]);
  }
}

// The same for Q6_K (a scale per 16 weights) and Q4_1 (kept in this order: one_scale_rows says why):
// per half of 16, acc[r][mv] += (dx dw) s [+ mw dxsum once per block].
template <int32_t F, class V, int NR, int MV>
inline void per_half_rows(const typename V::I* xa, const typename V::F* dx, const typename V::F& dxsum,
                          const Staged* st, typename V::F (*acc)[MV], int mv) {
  for (int r = 0; r < NR; ++r) {
    for (int p = 0; p < 2; ++p) {
      typename V::I s;
      if constexpr (unsigned_weights(F)) {
        s = V::set1(0);
        for (int i = 4 * p; i < 4 * p + 4; ++i) s = V::dot_wu(s, xa[i], st[r].bytes + 4 * i);
      } else {
        s = V::set1(st[r].corr[p]);
        for (int i = 4 * p; i < 4 * p + 4; ++i) s = V::dot(s, xa[i], st[r].bytes + 4 * i);
      }
      acc[r][mv] = V::fma(V::cvt(s), V::mul(dx[p], st[r].dw[p]), acc[r][mv]);
    }
    if constexpr (unsigned_weights(F)) acc[r][mv] = V::fma_s(dxsum, st[r].mw, acc[r][mv]);
  }
}

// NR W rows x MV lane groups, over all of K. out[r][mv * L + lane] = y of lane's row, W row r.
// STAGED: wrows point at rows of StagedBlock (one per block of 32) instead of the weights.
// ahead_bytes: from a W row to the same place NR rows later (the next tile's row), prefetched a
// tile ahead. Prefetching 1024 bytes ahead within the row left each tile's first KiB of every row to
// demand misses: at 32 rows of x the 1B Q8_0 gate/up (K = 2048) ran at 84% of down's (K = 8192)
// rate. One tile ahead, one thread of a Zen 4: Q8_0 gate/up 1.18-1.23x at 9-32 rows, down
// 1.04-1.08x; Q4_K gate/up 1.01-1.15x, Q6_K down 1.08-1.28x.
template <int32_t F, class V, int NR, int MV, bool STAGED>
inline void tile_vnni(const uint8_t* const* wrows, const uint8_t* act, int64_t K, float (*out)[4 * 16],
                      int64_t ahead_bytes) {
  using Spec = Fmt<F>;
  constexpr int L = V::L;
  constexpr bool OFFSET = tile_offset_form<F, MV, STAGED>();
  const int64_t group_bytes = vnni_group_bytes(K, L, OFFSET), block_bytes = vnni_block_bytes(L, OFFSET);
  typename V::F acc[NR][MV];
  for (int r = 0; r < NR; ++r)
    for (int mv = 0; mv < MV; ++mv) acc[r][mv] = V::zero();
  alignas(32) uint8_t buf[NR][32];
  const int64_t num_groups = K / (32 * Spec::G);
  for (int64_t grp = 0; grp < num_groups; ++grp) {
    float dw[NR][8], mw[NR][8];
    for (int r = 0; r < NR && !STAGED; ++r) {
      const uint8_t* g = wrows[r] + grp * Spec::BYTES;
      for (int off = 0; off < Spec::BYTES; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(g) + ahead_bytes + off, _MM_HINT_T0);
      group_scales<F>(g, dw[r], mw[r]);
    }
    for (int j = 0; j < Spec::G; ++j) {
      const int64_t b = grp * Spec::G + j;
      Staged st[NR];
      for (int r = 0; r < NR; ++r)
        if constexpr (STAGED) st[r] = reinterpret_cast<const StagedBlock*>(wrows[r])[b].s;
        else stage<F, OFFSET>(wrows[r] + grp * Spec::BYTES, j, dw[r], mw[r], buf[r], &st[r]);
      for (int mv = 0; mv < MV; ++mv) {
        const uint8_t* a = act + mv * group_bytes + b * block_bytes;
        typename V::I xa[8];
        for (int i = 0; i < 8; ++i) xa[i] = V::load(a + i * 4 * L);
        const float* dxp = reinterpret_cast<const float*>(a + 8 * 4 * L);
        const typename V::F dx[2] = {V::loadf(dxp), V::loadf(dxp + L)};
        if constexpr (F == DP_W_Q8_0 || F == DP_W_Q4_0 || F == DP_W_Q4_K)
          one_scale_rows<F, V, NR, MV, OFFSET>(xa, dx, V::loadf(dxp + 2 * L),
                                               reinterpret_cast<const int32_t*>(dxp + 3 * L), st, acc, mv);
        else
          per_half_rows<F, V, NR>(xa, dx, V::loadf(dxp + 2 * L), st, acc, mv);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int mv = 0; mv < MV; ++mv) V::store(out[r] + mv * L, acc[r][mv]);
}

}  // namespace dp_quant
