/* A GGUF file's K-quant blocks straight into the interleaved copies the int8 products read (see quant.py's
 * pack_x16 and int8_kernels.c's header for the layout): the same bytes the numpy repack makes (quant.py's
 * _repack_rows, k_sub_scales, _compact_blocks, _sub_table), in one pass over the blocks.  A model's load repacked
 * every weight in numpy, a dozen passes over temporaries (a 7B Q4_K_M file: ~20 s of a 29 s load on 2 cores).
 *
 * Called from the loader's threads (several at once, the GIL released): no OpenMP, no shared state.
 *
 * Both forms hold, per block of 16 rows, the codes of each group of weights in turn, then a scale table: the
 * signed byte of each group and row ([groups][16]), then each 256-weight block's half per row ([K/256][16]);
 * Q4_K's minima the same, with its halves negated.
 *   Q4_K (q4k/32): a group of 32 weights of 16 rows is 4 words j of [16 rows][4 bytes]; byte 4j + i of a row's
 *     group holds code 4j + i (low nibble) and code 4j + i + 16 (high nibble).
 *   Q6_K (q6k/16): a group of 16 weights of 16 rows is 2 words of [16 rows][4 bytes] of low nibbles (byte 4j + i:
 *     code 4j + i low, code 4j + i + 8 high), then [16 rows][4 bytes] of high bits: byte i holds the two high bits
 *     of code 4j + i at bits 2j, 2j + 1.
 */
#include <stdint.h>

#define Q4K_BYTES 144
#define Q6K_BYTES 210

/* Q4_K's 6-bit scale and minimum of sub-block j (0..7) from its 12 packed bytes q (llama.cpp's get_scale_min_k4) */
static inline void q4k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Row r's entries for 256-weight block s (bytes blk: d, dmin, the 12 bytes of scales and minima, as Q4_K and Q5_K
 * store them) in its block of 16 rows' scale table sb and minimum table mb (groups: K/32) */
static inline void k_tables(const uint8_t *blk, long s, int r, long groups, uint8_t *sb, uint8_t *mb) {
    sb[groups * 16 + (s * 16 + r) * 2] = blk[0]; /* d, as stored */
    sb[groups * 16 + (s * 16 + r) * 2 + 1] = blk[1];
    mb[groups * 16 + (s * 16 + r) * 2] = blk[2]; /* -dmin: the half's sign flipped */
    mb[groups * 16 + (s * 16 + r) * 2 + 1] = blk[3] ^ 0x80;
    for (int j = 0; j < 8; j++) q4k_scale_min(blk + 4, j, &sb[(s * 8 + j) * 16 + r], &mb[(s * 8 + j) * 16 + r]);
}

/* Blocks of 16 rows [0, nb16) of a Q4_K weight with rows of K weights (raw: the rows' blocks in file order) ->
 * codes [nb16][K/32][4][16][4], scales and minima [nb16][K/32 * 16 + K/256 * 32] */
void selfspec_repack_q4k(long nb16, long K, const uint8_t *raw, uint8_t *codes, uint8_t *scales, uint8_t *minima) {
    const long supers = K / 256, groups = K / 32, row_bytes = supers * Q4K_BYTES, table = groups * 16 + supers * 32;
    for (long b = 0; b < nb16; b++) {
        uint8_t *cb = codes + b * groups * 256, *sb = scales + b * table, *mb = minima + b * table;
        for (int r = 0; r < 16; r++) {
            const uint8_t *row = raw + (b * 16 + r) * row_bytes;
            for (long s = 0; s < supers; s++) {
                const uint8_t *blk = row + s * Q4K_BYTES, *q = blk + 16;
                k_tables(blk, s, r, groups, sb, mb);
                for (int c = 0; c < 4; c++) { /* 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high */
                    const uint8_t *qc = q + c * 32;
                    uint8_t *lo = cb + (s * 8 + 2 * c) * 256 + r * 4, *hi = lo + 256;
                    for (int k = 0; k < 16; k++) {
                        lo[(k >> 2) * 64 + (k & 3)] = (uint8_t)((qc[k] & 15) | ((qc[k + 16] & 15) << 4));
                        hi[(k >> 2) * 64 + (k & 3)] = (uint8_t)((qc[k] >> 4) | (qc[k + 16] & 0xF0));
                    }
                }
            }
        }
    }
}

/* Blocks of 16 rows [0, nb16) of a Q6_K weight with rows of K weights -> codes [nb16][K/16][192], scales
 * [nb16][K/16 * 16 + K/256 * 32] */
void selfspec_repack_q6k(long nb16, long K, const uint8_t *raw, uint8_t *codes, uint8_t *scales) {
    const long supers = K / 256, groups = K / 16, row_bytes = supers * Q6K_BYTES, table = groups * 16 + supers * 32;
    for (long b = 0; b < nb16; b++) {
        uint8_t *cb = codes + b * groups * 192, *sb = scales + b * table;
        for (int r = 0; r < 16; r++) {
            const uint8_t *row = raw + (b * 16 + r) * row_bytes;
            for (long s = 0; s < supers; s++) {
                const uint8_t *blk = row + s * Q6K_BYTES, *ql = blk, *qh = blk + 128, *sc = blk + 192;
                uint8_t u[256]; /* the codes 0..63 in element order (llama.cpp's dequantize_row_q6_K) */
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t a = ql[h * 64 + l], b2 = ql[h * 64 + l + 32], x = qh[h * 32 + l];
                        u[h * 128 + l] = (uint8_t)((a & 15) | ((x & 3) << 4));
                        u[h * 128 + 32 + l] = (uint8_t)((b2 & 15) | (((x >> 2) & 3) << 4));
                        u[h * 128 + 64 + l] = (uint8_t)((a >> 4) | (((x >> 4) & 3) << 4));
                        u[h * 128 + 96 + l] = (uint8_t)((b2 >> 4) | (((x >> 6) & 3) << 4));
                    }
                sb[groups * 16 + (s * 16 + r) * 2] = blk[208];
                sb[groups * 16 + (s * 16 + r) * 2 + 1] = blk[209];
                for (int gl = 0; gl < 16; gl++) {
                    const long g = s * 16 + gl;
                    const uint8_t *v = u + gl * 16;
                    uint8_t *out = cb + g * 192 + r * 4;
                    sb[g * 16 + r] = sc[gl];
                    for (int t = 0; t < 8; t++) out[(t >> 2) * 64 + (t & 3)] = (uint8_t)((v[t] & 15) | ((v[t + 8] & 15) << 4));
                    for (int i = 0; i < 4; i++)
                        out[128 + i] = (uint8_t)((v[i] >> 4) | ((v[4 + i] >> 4) << 2) | ((v[8 + i] >> 4) << 4) |
                                                 ((v[12 + i] >> 4) << 6));
                }
            }
        }
    }
}

/* A block's half scale h (its two bytes as stored) to at; 1 where it is a NaN (no half equals it, and the numpy
 * pack then keeps the weight's table in fp32: the caller takes that path), else 0 */
static inline long half_scale(const uint8_t *h, uint8_t *at) {
    at[0] = h[0];
    at[1] = h[1];
    return (h[1] & 0x7C) == 0x7C && ((h[1] & 3) | h[0]) != 0;
}

/* One row's group of 32 codes u (0..31) in the compact 5-bit form at out (its group's bytes of 16 rows, this row's
 * place in them): 4 words of [16 rows][4 bytes] of nibbles (byte 4j + i: code 4j + i low, code 4j + i + 16 high),
 * then [16 rows][4 bytes] of high bits (byte i: the fifth bit of code 4j + i at bit j) */
static inline void compact5(const uint8_t *u, uint8_t *out) {
    for (int t = 0; t < 16; t++) out[(t >> 2) * 64 + (t & 3)] = (uint8_t)((u[t] & 15) | ((u[t + 16] & 15) << 4));
    for (int i = 0; i < 4; i++) {
        uint8_t hb = 0;
        for (int j = 0; j < 8; j++) hb |= (uint8_t)((u[4 * j + i] >> 4) << j);
        out[256 + i] = hb;
    }
}

/* Blocks of 16 rows [0, nb16) of a Q5_K weight -> codes [nb16][K/32][320], scales and minima as Q4_K's */
void selfspec_repack_q5k(long nb16, long K, const uint8_t *raw, uint8_t *codes, uint8_t *scales, uint8_t *minima) {
    const long supers = K / 256, groups = K / 32, row_bytes = supers * 176, table = groups * 16 + supers * 32;
    for (long b = 0; b < nb16; b++) {
        uint8_t *cb = codes + b * groups * 320, *sb = scales + b * table, *mb = minima + b * table;
        for (int r = 0; r < 16; r++) {
            const uint8_t *row = raw + (b * 16 + r) * row_bytes;
            for (long s = 0; s < supers; s++) {
                const uint8_t *blk = row + s * 176, *qh = blk + 16, *qs = blk + 48;
                k_tables(blk, s, r, groups, sb, mb);
                for (int j = 0; j < 8; j++) {
                    uint8_t u[32]; /* sub-block j: nibbles of bytes (j / 2) * 32 + l (low for even j), bit j of qh */
                    for (int l = 0; l < 32; l++) {
                        const uint8_t q = qs[(j >> 1) * 32 + l];
                        u[l] = (uint8_t)(((j & 1) ? q >> 4 : q & 15) | (((qh[l] >> j) & 1) << 4));
                    }
                    compact5(u, cb + (s * 8 + j) * 320 + r * 4);
                }
            }
        }
    }
}

/* Blocks of 16 rows [0, nb16) of a Q8_0 (five: 0) or Q5_0 (five: 1) weight with rows of K weights -> codes
 * [nb16][K/32][8][16][4] (Q8_0: each code + 128, as a byte) or [nb16][K/32][320] (Q5_0: each code + 16, compact),
 * scales [nb16][K/32][16] (the halves as stored).  Returns how many scales are NaN. */
static long half_scaled(long nb16, long K, const uint8_t *raw, uint8_t *codes, uint8_t *scales, const int five) {
    const long groups = K / 32, block = five ? 22 : 34, group_bytes = five ? 320 : 512, row_bytes = groups * block;
    long nans = 0;
    for (long b = 0; b < nb16; b++) {
        uint8_t *cb = codes + b * groups * group_bytes, *sb = scales + b * groups * 32;
        for (int r = 0; r < 16; r++) {
            const uint8_t *row = raw + (b * 16 + r) * row_bytes;
            for (long g = 0; g < groups; g++) {
                const uint8_t *blk = row + g * block;
                uint8_t *out = cb + g * group_bytes + r * 4;
                nans += half_scale(blk, sb + (g * 16 + r) * 2);
                if (!five) {
                    for (int k = 0; k < 32; k++) out[(k >> 2) * 64 + (k & 3)] = blk[2 + k] ^ 0x80;
                    continue;
                }
                const uint8_t *qh = blk + 2, *qs = blk + 6;
                uint8_t u[32]; /* element e: a nibble of byte e % 16 (low for e < 16), bit e of qh */
                for (int e = 0; e < 32; e++)
                    u[e] = (uint8_t)((e < 16 ? qs[e] & 15 : qs[e - 16] >> 4) | (((qh[e >> 3] >> (e & 7)) & 1) << 4));
                compact5(u, out);
            }
        }
    }
    return nans;
}

long selfspec_repack_q80(long nb16, long K, const uint8_t *raw, uint8_t *codes, uint8_t *scales) {
    return half_scaled(nb16, K, raw, codes, scales, 0);
}

long selfspec_repack_q50(long nb16, long K, const uint8_t *raw, uint8_t *codes, uint8_t *scales) {
    return half_scaled(nb16, K, raw, codes, scales, 1);
}
