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
 * Stores are ordinary (not non-temporal): the target reads its blocks back soon after to verify
 * them, and a transfer is often smaller than the last-level cache.
 */

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

/* The raw CRC register `r` (no inversions) run over n bytes; copies them to dst when dst != 0. */
static uint32_t crc_register(uint32_t r, uint8_t *dst, const uint8_t *src, size_t n) {
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
    return 1;
#else
    return 0;
#endif
}

/* crc32c.crc32c(src[:n], crc), copying the bytes to dst on the way (dst may be 0: no copy). */
uint32_t dp_copy_crc32c(uint8_t *dst, const uint8_t *src, int64_t n, uint32_t crc) {
    return ~crc_register(~crc, dst, src, (size_t)n);
}

/* One layer of a KV transfer: for K, then V, each run (src_slot, dst_slot, num_slots) of `runs`
 * copied from src to dst (slot_bytes per slot; dst_k/dst_v 0: no copy), and the CRC32C of the
 * source's bytes in that order, starting from 0 (as crc32c.crc32c chained over the runs). */
uint32_t dp_kv_layer_copy_crc32c(uint8_t *dst_k, uint8_t *dst_v, const uint8_t *src_k, const uint8_t *src_v,
                                 const int64_t *runs, int64_t num_runs, int64_t slot_bytes) {
    uint32_t r = 0xffffffffu;
    for (int part = 0; part < 2; part++) {
        uint8_t *dst = part == 0 ? dst_k : dst_v;
        const uint8_t *src = part == 0 ? src_k : src_v;
        for (int64_t i = 0; i < num_runs; i++) {
            const int64_t *run = runs + 3 * i;
            r = crc_register(r, dst ? dst + run[1] * slot_bytes : 0, src + run[0] * slot_bytes,
                             (size_t)(run[2] * slot_bytes));
        }
    }
    return ~r;
}

/* dp_kv_layer_copy_crc32c over num_layers consecutive layers in one call (the layers of each pool
 * src_layer_bytes / dst_layer_bytes apart; the pointers are those of the first layer), the layers'
 * CRC32Cs written to crc32s[0 .. num_layers - 1]. One call instead of one per layer: the per-call
 * cost from Python (argument conversion, the GIL's release and retake) was about 10 us a layer,
 * more than checksumming a layer of a 16-token transfer. */
void dp_kv_layers_copy_crc32c(uint8_t *dst_k, uint8_t *dst_v, const uint8_t *src_k, const uint8_t *src_v,
                              int64_t src_layer_bytes, int64_t dst_layer_bytes, int64_t num_layers,
                              const int64_t *runs, int64_t num_runs, int64_t slot_bytes, uint32_t *crc32s) {
    for (int64_t layer = 0; layer < num_layers; layer++) {
        int64_t src_offset = layer * src_layer_bytes, dst_offset = layer * dst_layer_bytes;
        crc32s[layer] = dp_kv_layer_copy_crc32c(dst_k ? dst_k + dst_offset : 0, dst_v ? dst_v + dst_offset : 0,
                                                src_k + src_offset, src_v + src_offset, runs, num_runs, slot_bytes);
    }
}
