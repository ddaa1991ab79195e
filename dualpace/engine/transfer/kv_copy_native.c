/* Copy KV bytes and compute their CRC32C in one pass (loaded by kv_copy_native.py).
 *
 * The shared-memory KV transfer copies each layer's K and V runs into the target's blocks and
 * sends the layer's CRC32C (Castagnoli, the value the `crc32c` package computes: initial and
 * final inversion, reflected). Done in numpy + the package, the source is read twice (once by
 * the copy, once by the CRC). Here each 8-byte word is loaded once, stored once and folded into
 * the CRC while in a register.
 *
 * The CRC instruction has a latency of about 3 cycles and a throughput of one per cycle, so one
 * chain of it runs at a third of what the core can do. Large spans are cut into three lanes of
 * lane_sizes bytes each, CRC'd as three independent chains interleaved in the loop, and the lanes'
 * CRCs are then joined: a CRC register r run over a span X gives r * x^(8|X|) xor crc0(X) (mod P),
 * so a lane's register is moved past the next lane by one carry-less multiply modulo P with the
 * constant x^(8 lane), computed once.
 *
 * Where the CPU has VPCLMULQDQ, spans of 256 bytes and more take a folding loop instead (below): the
 * CRC carried as 128-bit remainders folded forward by carry-less multiplies, 64-byte loads and
 * stores on AVX-512 (zmm), 32-byte ones where only AVX2 is there (ymm, e.g. Zen 3); in cache about
 * twice the crc32 lanes' rate. dp_kv_set_crc_path forces a loop (tests compare them).
 *
 * Stores are ordinary (the target reads its blocks back soon after to verify them) unless the
 * caller asks for streaming ones (dp_kv_layer_copy_crc32c's `stream`, for transfers larger than
 * the caches; 64-byte non-temporal stores on the zmm loop only: 8-byte ones measured 4x slower on
 * Zen 3).
 */

#include <immintrin.h>
#include <nmmintrin.h>
#include <stdint.h>
#include <string.h>

/* Lane sizes, largest first: a span takes the largest whose round of three lanes fits in it (so a
 * 16-token layer of the default model, 12 KB per K or V, still runs three chains, not one). For
 * large spans 16 KB lanes: 4 KB lanes alone measured slower there (two joins per round). */
#define NUM_LANE_SIZES 3
static const size_t lane_sizes[NUM_LANE_SIZES] = {16384, 4096, 1024};
#define POLY_REFLECTED 0x82f63b78u

static uint32_t lane_shift_constants[NUM_LANE_SIZES]; /* x^(8 lane) mod P, reflected; 0 until computed */

/* a * b modulo P, both reflected (bit 31 is x^0). */
static uint32_t multiply_mod_p(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int bit = 31; bit >= 0; bit--) {
        if (a & (1u << bit)) product ^= b;
        b = (b & 1u) ? (b >> 1) ^ POLY_REFLECTED : b >> 1; /* b * x */
    }
    return product;
}

static uint32_t shift_constant(int size_index) {
    uint32_t constant = lane_shift_constants[size_index];
    if (constant == 0) {
        /* x^0 (reflected: bit 31) run over `lane` zero bytes is x^(8 lane) mod P. */
        uint64_t r = 0x80000000u;
        for (size_t i = 0; i < lane_sizes[size_index] / 8; i++) r = _mm_crc32_u64(r, 0);
        constant = (uint32_t)r;
        lane_shift_constants[size_index] = constant; /* dp_kv_copy_supported computes them before any copy */
    }
    return constant;
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t word;
    memcpy(&word, p, 8);
    return word;
}

static inline void store64(uint8_t *p, uint64_t word) { memcpy(p, &word, 8); }


/* ---- Folding CRC32C (VPCLMULQDQ, 512-bit) ----
 *
 * Reflected convention: a 128-bit chunk loaded little-endian from the stream has its bit i as the
 * coefficient of x^(127-i) (bit 0 is sent first and is the highest power). Its low qword XL covers
 * x^127..x^64, the high qword XH x^63..x^0. Moving a chunk X forward by D bits, to be xored into
 * the chunk D bits later, is X * x^D = XL * x^(64+D) + XH * x^D; mod P both powers shrink to
 * degree < 32 and the products to degree < 96, inside the later chunk. A carry-less multiply of two
 * reflected qwords (bit i <-> x^(63-i)) gives bit k <-> x^(126-k), one power short of the chunk's
 * x^(127-k): hence the constants are x^(64+D-1) and x^(D-1) mod P, each as a reflected qword (x^j at
 * bit 63-j). All folding keeps the raw CRC of the stream (register 0 at its start) unchanged, so
 * the last 128-bit remainder is run through the crc32 instruction as 16 data bytes; the CRC's
 * starting register is xored into the first 4 data bytes, the same thing as starting from it. */

#define POLY_NORMAL 0x11edc6f41ull /* x^32 + ... , bit j <-> x^j */

/* x^n mod P, bit j <-> x^j. */
static uint32_t x_power_mod_p(unsigned n) {
    uint64_t v = 1;
    for (unsigned i = 0; i < n; i++) {
        v <<= 1;
        if (v & (1ull << 32)) v ^= POLY_NORMAL;
    }
    return (uint32_t)v;
}

/* The polynomial p (bit j <-> x^j, degree < 32) as a reflected qword (x^j at bit 63 - j). */
static uint64_t reflected_qword(uint32_t p) {
    uint64_t q = 0;
    for (int j = 0; j < 32; j++)
        if (p & (1u << j)) q |= 1ull << (63 - j);
    return q;
}

/* Folding by D bits: low qword x^(64+D-1), high qword x^(D-1), mod P. */
typedef struct { uint64_t low, high; } fold_constant;
static fold_constant fold_constant_for(unsigned distance_bits) {
    fold_constant c = {reflected_qword(x_power_mod_p(64 + distance_bits - 1)),
                       reflected_qword(x_power_mod_p(distance_bits - 1))};
    return c;
}

static fold_constant fold_2048, fold_1024, fold_512, fold_384, fold_256, fold_128; /* set by crc_fold_init */
/* The folding loops: FOLD_512 on zmm registers (AVX-512 + VPCLMULQDQ), FOLD_256 on ymm ones (AVX2 +
 * VPCLMULQDQ: e.g. Zen 3); NO_FOLD is the crc32 lanes. */
enum { NO_FOLD = 0, FOLD_512 = 1, FOLD_256 = 2 };
static int fold_512_available, fold_256_available; /* what the CPU has (set once, before any copy) */
static int crc_fold_enabled;                      /* the loop in use (dp_kv_set_crc_path) */
#define FOLD_MIN_BYTES 256

static void crc_fold_init(void) {
    fold_2048 = fold_constant_for(2048);
    fold_1024 = fold_constant_for(1024);
    fold_512 = fold_constant_for(512);
    fold_384 = fold_constant_for(384);
    fold_256 = fold_constant_for(256);
    fold_128 = fold_constant_for(128);
}

#define FOLD_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.2")))

FOLD_TARGET static inline __m512i fold_512bit(__m512i x, __m512i k, __m512i next) {
    __m512i a = _mm512_clmulepi64_epi128(x, k, 0x00), b = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(a, b, next, 0x96); /* a ^ b ^ next */
}

#define FOLD128_TARGET __attribute__((target("pclmul,sse4.2"))) /* a subset of both wide loops' targets */

FOLD128_TARGET static inline __m128i fold_128bit(__m128i x, fold_constant c, __m128i next) {
    __m128i k = _mm_set_epi64x((long long)c.high, (long long)c.low);
    __m128i a = _mm_clmulepi64_si128(x, k, 0x00), b = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(a, b), next);
}

/* After a wide loop: its 128-bit remainder x folded on over the 16-byte blocks from src + i (copied
 * when COPY), then run through the crc32 instruction as 16 data bytes; *done the bytes consumed. */
FOLD128_TARGET static inline uint32_t fold_tail(__m128i x, uint8_t *dst, const uint8_t *src, size_t i, size_t n,
                                                size_t *done, const int copy) {
    for (; i + 16 <= n; i += 16) {
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i));
        if (copy) _mm_storeu_si128((__m128i *)(dst + i), d);
        x = fold_128bit(x, fold_128, d);
    }
    *done = i;
    uint64_t reg = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    return (uint32_t)_mm_crc32_u64(reg, (uint64_t)_mm_extract_epi64(x, 1));
}

FOLD_TARGET static inline __m512i broadcast_constant(fold_constant c) {
    return _mm512_broadcast_i32x4(_mm_set_epi64x((long long)c.high, (long long)c.low));
}

/* The raw CRC register r run over the largest multiple of 16 bytes of n (at least FOLD_MIN_BYTES),
 * copying them to dst when COPY (with non-temporal stores in the main loop when STREAM and dst is
 * 64-byte aligned); returns the register, *done the bytes consumed. */
FOLD_TARGET static inline uint32_t kv_crc_fold_impl(uint32_t r, uint8_t *dst, const uint8_t *src, size_t n,
                                                    size_t *done, const int copy, const int stream) {
    __m512i a0 = _mm512_loadu_si512(src), a1 = _mm512_loadu_si512(src + 64);
    __m512i a2 = _mm512_loadu_si512(src + 128), a3 = _mm512_loadu_si512(src + 192);
    if (copy) {
        _mm512_storeu_si512(dst, a0);
        _mm512_storeu_si512(dst + 64, a1);
        _mm512_storeu_si512(dst + 128, a2);
        _mm512_storeu_si512(dst + 192, a3);
    }
    a0 = _mm512_xor_si512(a0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)r))); /* the starting register */
    size_t i = 256;
    const __m512i k2048 = broadcast_constant(fold_2048);
    for (; i + 256 <= n; i += 256) {
        __m512i d0 = _mm512_loadu_si512(src + i), d1 = _mm512_loadu_si512(src + i + 64);
        __m512i d2 = _mm512_loadu_si512(src + i + 128), d3 = _mm512_loadu_si512(src + i + 192);
        if (copy && stream) { /* dst + i is 64-byte aligned: i is a multiple of 256, dst checked below */
            _mm512_stream_si512((void *)(dst + i), d0);
            _mm512_stream_si512((void *)(dst + i + 64), d1);
            _mm512_stream_si512((void *)(dst + i + 128), d2);
            _mm512_stream_si512((void *)(dst + i + 192), d3);
        } else if (copy) {
            _mm512_storeu_si512(dst + i, d0);
            _mm512_storeu_si512(dst + i + 64, d1);
            _mm512_storeu_si512(dst + i + 128, d2);
            _mm512_storeu_si512(dst + i + 192, d3);
        }
        a0 = fold_512bit(a0, k2048, d0);
        a1 = fold_512bit(a1, k2048, d1);
        a2 = fold_512bit(a2, k2048, d2);
        a3 = fold_512bit(a3, k2048, d3);
    }
    const __m512i k512 = broadcast_constant(fold_512);
    a1 = fold_512bit(a0, k512, a1);
    a2 = fold_512bit(a1, k512, a2);
    a3 = fold_512bit(a2, k512, a3); /* one 64-byte remainder, its four lanes in stream order */
    __m128i x = fold_128bit(_mm512_extracti32x4_epi32(a3, 0), fold_384, _mm512_extracti32x4_epi32(a3, 3));
    x = fold_128bit(_mm512_extracti32x4_epi32(a3, 1), fold_256, x);
    x = fold_128bit(_mm512_extracti32x4_epi32(a3, 2), fold_128, x);
    return fold_tail(x, dst, src, i, n, done, copy);
}

FOLD_TARGET static uint32_t kv_crc_fold_copy(uint32_t r, uint8_t *dst, const uint8_t *src, size_t n, size_t *done,
                                             int stream) {
    if (stream && !((uintptr_t)dst & 63)) return kv_crc_fold_impl(r, dst, src, n, done, 1, 1);
    return kv_crc_fold_impl(r, dst, src, n, done, 1, 0);
}

FOLD_TARGET static uint32_t kv_crc_fold_read(uint32_t r, const uint8_t *src, size_t n, size_t *done) {
    return kv_crc_fold_impl(r, 0, src, n, done, 0, 0);
}

/* The same on 256-bit registers (two 128-bit lanes each, four accumulators: 128 bytes a round). */
#define FOLD256_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

FOLD256_TARGET static inline __m256i fold_256bit(__m256i x, __m256i k, __m256i next) {
    __m256i a = _mm256_clmulepi64_epi128(x, k, 0x00), b = _mm256_clmulepi64_epi128(x, k, 0x11);
    return _mm256_xor_si256(_mm256_xor_si256(a, b), next);
}

FOLD256_TARGET static inline __m256i broadcast_constant_256(fold_constant c) {
    return _mm256_broadcastsi128_si256(_mm_set_epi64x((long long)c.high, (long long)c.low));
}

FOLD256_TARGET static inline uint32_t kv_crc_fold256_impl(uint32_t r, uint8_t *dst, const uint8_t *src, size_t n,
                                                          size_t *done, const int copy) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)src), a1 = _mm256_loadu_si256((const __m256i *)(src + 32));
    __m256i a2 = _mm256_loadu_si256((const __m256i *)(src + 64)), a3 = _mm256_loadu_si256((const __m256i *)(src + 96));
    if (copy) {
        _mm256_storeu_si256((__m256i *)dst, a0);
        _mm256_storeu_si256((__m256i *)(dst + 32), a1);
        _mm256_storeu_si256((__m256i *)(dst + 64), a2);
        _mm256_storeu_si256((__m256i *)(dst + 96), a3);
    }
    a0 = _mm256_xor_si256(a0, _mm256_set_m128i(_mm_setzero_si128(), _mm_cvtsi32_si128((int)r)));
    size_t i = 128;
    const __m256i k1024 = broadcast_constant_256(fold_1024);
    for (; i + 128 <= n; i += 128) {
        __m256i d0 = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i d2 = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d3 = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        if (copy) {
            _mm256_storeu_si256((__m256i *)(dst + i), d0);
            _mm256_storeu_si256((__m256i *)(dst + i + 32), d1);
            _mm256_storeu_si256((__m256i *)(dst + i + 64), d2);
            _mm256_storeu_si256((__m256i *)(dst + i + 96), d3);
        }
        a0 = fold_256bit(a0, k1024, d0);
        a1 = fold_256bit(a1, k1024, d1);
        a2 = fold_256bit(a2, k1024, d2);
        a3 = fold_256bit(a3, k1024, d3);
    }
    const __m256i k256 = broadcast_constant_256(fold_256);
    a1 = fold_256bit(a0, k256, a1);
    a2 = fold_256bit(a1, k256, a2);
    a3 = fold_256bit(a2, k256, a3); /* one 32-byte remainder, its two lanes in stream order */
    __m128i x = fold_128bit(_mm256_castsi256_si128(a3), fold_128, _mm256_extracti128_si256(a3, 1));
    return fold_tail(x, dst, src, i, n, done, copy);
}

FOLD256_TARGET static uint32_t kv_crc_fold256_copy(uint32_t r, uint8_t *dst, const uint8_t *src, size_t n,
                                                   size_t *done) {
    return kv_crc_fold256_impl(r, dst, src, n, done, 1);
}

FOLD256_TARGET static uint32_t kv_crc_fold256_read(uint32_t r, const uint8_t *src, size_t n, size_t *done) {
    return kv_crc_fold256_impl(r, 0, src, n, done, 0);
}

/* The raw CRC register `r` (no inversions) run over n bytes; copies them to dst when dst != 0 (with
 * non-temporal stores where `stream` and the zmm folding loop runs: see dp_kv_layer_copy_crc32c). */
static uint32_t crc_register(uint32_t r, uint8_t *dst, const uint8_t *src, size_t n, int stream) {
    if (crc_fold_enabled != NO_FOLD && n >= FOLD_MIN_BYTES) {
        size_t done;
        if (crc_fold_enabled == FOLD_512)
            r = dst ? kv_crc_fold_copy(r, dst, src, n, &done, stream) : kv_crc_fold_read(r, src, n, &done);
        else
            r = dst ? kv_crc_fold256_copy(r, dst, src, n, &done) : kv_crc_fold256_read(r, src, n, &done);
        src += done;
        n -= done;
        if (dst) dst += done;
    }
    uint64_t r0 = r;
    for (int size_index = 0; size_index < NUM_LANE_SIZES; size_index++) {
        const size_t lane = lane_sizes[size_index];
        if (n < 3 * lane) continue;
        const uint32_t constant = shift_constant(size_index);
        while (n >= 3 * lane) {
            uint64_t r1 = 0, r2 = 0;
            const uint8_t *s = src;
            if (dst) {
                uint8_t *d = dst;
                for (size_t i = 0; i < lane; i += 8) {
                    uint64_t w0 = load64(s + i), w1 = load64(s + lane + i), w2 = load64(s + 2 * lane + i);
                    store64(d + i, w0);
                    store64(d + lane + i, w1);
                    store64(d + 2 * lane + i, w2);
                    r0 = _mm_crc32_u64(r0, w0);
                    r1 = _mm_crc32_u64(r1, w1);
                    r2 = _mm_crc32_u64(r2, w2);
                }
                dst += 3 * lane;
            } else {
                for (size_t i = 0; i < lane; i += 8) {
                    r0 = _mm_crc32_u64(r0, load64(s + i));
                    r1 = _mm_crc32_u64(r1, load64(s + lane + i));
                    r2 = _mm_crc32_u64(r2, load64(s + 2 * lane + i));
                }
            }
            r0 = multiply_mod_p((uint32_t)r0, constant) ^ (uint32_t)r1;
            r0 = multiply_mod_p((uint32_t)r0, constant) ^ (uint32_t)r2;
            src += 3 * lane;
            n -= 3 * lane;
        }
    }
    for (; n >= 8; n -= 8, src += 8) {
        uint64_t word = load64(src);
        if (dst) {
            store64(dst, word);
            dst += 8;
        }
        r0 = _mm_crc32_u64(r0, word);
    }
    uint32_t r32 = (uint32_t)r0;
    for (; n > 0; n--, src++) {
        if (dst) *dst++ = *src;
        r32 = _mm_crc32_u8(r32, *src);
    }
    return r32;
}

/* The CRC instruction is there (the library is built with -msse4.2; call this before anything else). */
int dp_kv_copy_supported(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return 0;
    for (int i = 0; i < NUM_LANE_SIZES; i++) shift_constant(i); /* here, once, before any thread copies */
    crc_fold_init();
    fold_256_available = __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul")
                         && __builtin_cpu_supports("avx2");
    fold_512_available = fold_256_available && __builtin_cpu_supports("avx512f")
                         && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    crc_fold_enabled = fold_512_available ? FOLD_512 : fold_256_available ? FOLD_256 : NO_FOLD;
    return 1;
#else
    return 0;
#endif
}

/* Which CRC loop runs: 1 folding on zmm, 2 folding on ymm, 0 the crc32 lanes. */
int dp_kv_crc_path(void) { return crc_fold_enabled; }

/* Choose the CRC loop: 1 the widest folding the CPU has, 2 the ymm folding, 0 the crc32 lanes (each
 * where the CPU has it, else the next narrower); returns the one in force. For tests and
 * benchmarks; call it while no copy runs. */
int dp_kv_set_crc_path(int path) {
    if (path == FOLD_512 && fold_512_available) crc_fold_enabled = FOLD_512;
    else if (path != NO_FOLD && fold_256_available) crc_fold_enabled = FOLD_256;
    else crc_fold_enabled = NO_FOLD;
    return crc_fold_enabled;
}

/* crc32c.crc32c(src[:n], crc), copying the bytes to dst on the way (dst may be 0: no copy). */
uint32_t dp_copy_crc32c(uint8_t *dst, const uint8_t *src, int64_t n, uint32_t crc) {
    return ~crc_register(~crc, dst, src, (size_t)n, 0);
}

/* One layer of a KV transfer: for K, then V, each run (src_slot, dst_slot, num_slots) of `runs`
 * copied from src to dst (slot_bytes per slot; dst_k/dst_v 0: no copy), and the CRC32C of the
 * source's bytes in that order, starting from 0 (as crc32c.crc32c chained over the runs).
 * `stream`: the stores bypass the caches (non-temporal, on the zmm folding loop's 64-byte-aligned
 * runs): for transfers larger than the caches, where a store that first reads its line (as an
 * ordinary store does) costs a third more memory traffic; the stores are fenced before returning. */
uint32_t dp_kv_layer_copy_crc32c(uint8_t *dst_k, uint8_t *dst_v, const uint8_t *src_k, const uint8_t *src_v,
                                 const int64_t *runs, int64_t num_runs, int64_t slot_bytes, int64_t stream) {
    uint32_t r = 0xffffffffu;
    for (int part = 0; part < 2; part++) {
        uint8_t *dst = part == 0 ? dst_k : dst_v;
        const uint8_t *src = part == 0 ? src_k : src_v;
        for (int64_t i = 0; i < num_runs; i++) {
            const int64_t *run = runs + 3 * i;
            r = crc_register(r, dst ? dst + run[1] * slot_bytes : 0, src + run[0] * slot_bytes,
                             (size_t)(run[2] * slot_bytes), (int)stream);
        }
    }
    if (stream) _mm_sfence(); /* the streamed stores are visible before anything this thread does next */
    return ~r;
}

/* dp_kv_layer_copy_crc32c over num_layers consecutive layers in one call (the layers of each pool
 * src_layer_bytes / dst_layer_bytes apart; the pointers are those of the first layer), the layers'
 * CRC32Cs written to crc32s[0 .. num_layers - 1]. One call instead of one per layer: the per-call
 * cost from Python (argument conversion, the GIL's release and retake) was about 10 us a layer,
 * more than checksumming a layer of a 16-token transfer. */
void dp_kv_layers_copy_crc32c(uint8_t *dst_k, uint8_t *dst_v, const uint8_t *src_k, const uint8_t *src_v,
                              int64_t src_layer_bytes, int64_t dst_layer_bytes, int64_t num_layers,
                              const int64_t *runs, int64_t num_runs, int64_t slot_bytes, uint32_t *crc32s,
                              int64_t stream) {
    for (int64_t layer = 0; layer < num_layers; layer++) {
        int64_t src_offset = layer * src_layer_bytes, dst_offset = layer * dst_layer_bytes;
        crc32s[layer] = dp_kv_layer_copy_crc32c(dst_k ? dst_k + dst_offset : 0, dst_v ? dst_v + dst_offset : 0,
                                                src_k + src_offset, src_v + src_offset, runs, num_runs, slot_bytes,
                                                stream);
    }
}
