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
 * LANE_BYTES each, CRC'd as three independent chains interleaved in the loop, and the lanes'
 * CRCs are then joined: a CRC register r run over a span X gives r * x^(8|X|) xor crc0(X) (mod P),
 * so a lane's register is moved past the next lane by one carry-less multiply modulo P with the
 * constant x^(8 LANE_BYTES), computed once.
 *
 * Stores are ordinary (not non-temporal): the target reads its blocks back soon after to verify
 * them, and a transfer is often smaller than the last-level cache.
 */

#include <nmmintrin.h>
#include <stdint.h>
#include <string.h>

#define LANE_BYTES 16384 /* per lane; three lanes per round (4096 measured slower) */
#define POLY_REFLECTED 0x82f63b78u

static uint32_t lane_shift_constant; /* x^(8 LANE_BYTES) mod P, reflected; 0 until computed */

/* a * b modulo P, both reflected (bit 31 is x^0). */
static uint32_t multiply_mod_p(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int bit = 31; bit >= 0; bit--) {
        if (a & (1u << bit)) product ^= b;
        b = (b & 1u) ? (b >> 1) ^ POLY_REFLECTED : b >> 1; /* b * x */
    }
    return product;
}

static uint32_t shift_constant(void) {
    uint32_t constant = lane_shift_constant;
    if (constant == 0) {
        /* x^0 (reflected: bit 31) run over LANE_BYTES zero bytes is x^(8 LANE_BYTES) mod P. */
        uint64_t r = 0x80000000u;
        for (int i = 0; i < LANE_BYTES / 8; i++) r = _mm_crc32_u64(r, 0);
        constant = (uint32_t)r;
        lane_shift_constant = constant; /* dp_kv_copy_supported computes it before any copy */
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
    if (n >= 3 * LANE_BYTES) {
        const uint32_t constant = shift_constant();
        while (n >= 3 * LANE_BYTES) {
            uint64_t r1 = 0, r2 = 0;
            const uint8_t *s = src;
            if (dst) {
                uint8_t *d = dst;
                for (size_t i = 0; i < LANE_BYTES; i += 8) {
                    uint64_t w0 = load64(s + i), w1 = load64(s + LANE_BYTES + i), w2 = load64(s + 2 * LANE_BYTES + i);
                    store64(d + i, w0);
                    store64(d + LANE_BYTES + i, w1);
                    store64(d + 2 * LANE_BYTES + i, w2);
                    r0 = _mm_crc32_u64(r0, w0);
                    r1 = _mm_crc32_u64(r1, w1);
                    r2 = _mm_crc32_u64(r2, w2);
                }
                dst += 3 * LANE_BYTES;
            } else {
                for (size_t i = 0; i < LANE_BYTES; i += 8) {
                    r0 = _mm_crc32_u64(r0, load64(s + i));
                    r1 = _mm_crc32_u64(r1, load64(s + LANE_BYTES + i));
                    r2 = _mm_crc32_u64(r2, load64(s + 2 * LANE_BYTES + i));
                }
            }
            r0 = multiply_mod_p((uint32_t)r0, constant) ^ (uint32_t)r1;
            r0 = multiply_mod_p((uint32_t)r0, constant) ^ (uint32_t)r2;
            src += 3 * LANE_BYTES;
            n -= 3 * LANE_BYTES;
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
    shift_constant(); /* computed here, once, before any thread copies */
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
