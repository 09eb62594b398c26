/* selfspec's int8-activation products of quantised weights (see quant.py: `activations`, and pack_x16 there).
 *
 * The fp32 row kernels of quant_kernels.c decode every weight to fp32 and spend one fused multiply-add per weight
 * and row of x: on a 2-core machine a product of 4-16 rows is bound by that arithmetic, not by reading the
 * weights, so each extra drafted token cost almost as much to verify as the first.  Here, as in llama.cpp's
 * CPU kernels, each row of x is first quantised to int8 in blocks of 32 (scale = max|x| / 127, round to
 * nearest even), and the weights' integer codes meet it in VNNI dot products (vpdpbusd: 64 byte products per
 * instruction, four times the lanes of an fp32 multiply-add).
 *
 * Weights are interleaved for it ("x16"): 16 output rows side by side, so one dot product instruction yields 4
 * consecutive k of all 16 rows and no horizontal sum is ever needed.  For a block of 16 rows and a group of G
 * weights (G = 32 for q4, 16 or 32 for q8), the codes are G / 4 groups of 64 bytes, byte 4r + i of group j
 * holding code k = 4j + i of row r; q4 packs k = 4j + i in the low nibble and k = 16 + 4j + i in the high
 * nibble of the same byte (exactly the bytes of quant.py's q4 form, reordered), q8 stores code + 128 as an
 * unsigned byte.  Per group and row: scale d and minimum m with w = d * code + m (q8: m already includes
 * -128 d; a symmetric q8 weight, Q8_0, stores no minimum and m = -128 d is computed: a tenth less to read; a
 * symmetric q4 weight, the 4-bit draft copies of quant.py's low_bit_copy, likewise m = -8 d: a sixth less).
 * A row's product is then  sum_g  d_g * dx_g * sum_k(code * xq)  +  m_g * dx_g * sum_k(xq).
 * Compact forms of 5- and 6-bit codes (BITS 5 and 6: Q5_0/Q5_1/Q5_K and Q6_K, which the row form holds as a byte
 * per code): the code u = code - c0 (0..31 or 0..63; c0 = -16 for Q5_0, -32 for Q6_K, 0 with stored minima) is
 * split into its low nibble, laid out as q4's bytes (BITS 5, G 32: four 64-byte groups, k = 4j + i low and
 * k = 16 + 4j + i high; BITS 6, G 16: two, k = 4j + i low and k = 8 + 4j + i high), and its high bits, one more
 * 64-byte group whose byte 4r + i holds bit 4 of code k = 4j + i in its bit j (BITS 5) or bits 4-5 in its bits
 * 2j, 2j + 1 (BITS 6).  A group of 16 rows then takes 320 bytes for 32 codes (q8: 512) or 192 for 16 (q8: 256),
 * and m = -16 d or -32 d for the symmetric types (stored minima are the row form's own, exact).
 *
 * Forms of 2 and 3 bits, G 16 (Q2_K's codes 0..3 with stored minima; Q3_K's -4..3 as u = code + 4, 0..7,
 * symmetric: m = -4 d): a 64-byte group whose byte 4r + i holds the low two bits of code k = 4j + i in its bits
 * 2j, 2j + 1 (64 bytes for 16 codes of 16 rows), and for BITS 3 a 32-byte group of third bits, byte 4r' + i
 * (r' = r mod 8) holding bit 2 of code k = 4j + i of row r in bit j + 4 (r div 8) (96 bytes).  LUT4, G 32
 * (IQ4_NL / IQ4_XS), q4's nibble layout: the nibbles are indices into IQ4's 16 non-uniform levels, which a byte
 * shuffle (vpshufb; a table in portable C) turns into the level + 128, then taken as a q8 code (m = -128 d): the
 * weights read at the file's 4 bits where a byte a code was read.
 *
 * Scales (and minima) are fp32, or IEEE halves where every one of them is a half exactly (the GGUF types that store
 * fp16 scales: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the 4-bit draft copies, whose scales are rounded to halves): a
 * product's `form` argument is BITS | X16_SCALE16.  Widening a half is exact, so the products are bit for bit those
 * of fp32 scales, from 2 bytes a scale instead of 4 (Q4_1: a sixth of the bytes read; Q8_0: a eighteenth).
 * The K-quants (Q4_K, Q5_K, Q6_K) store each scale as a small integer (6 bits, Q6_K: 8) times a half per 256
 * weights: with X16_SUB8 their copies keep that form, a signed byte per group and row, then a half per 256 weights
 * and row ([groups][16] bytes, then [K / 256][16] halves, per block of 16 rows; minima likewise, with the
 * minimum's half negated).  Their product is exact in fp32 (at most 8 + 11 significant bits), so the scales are
 * bit for bit the row form's, from 1.1-1.25 bytes a scale instead of 4 (Q4_K's copy: 4.6 bits a weight, was 6).
 *
 * Row independence (what keeps speculative decoding token-identical): a row of x is quantised on its own, its
 * integer sums are exact, and its float operations run in the same order whatever the number of rows T in
 * the call.  The portable C path performs the same operations (fmaf where the vector code fuses).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SELFSPEC_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SELFSPEC_AVX2 1
#include <immintrin.h>
#if defined(__AVXVNNI__)
#define SELFSPEC_AVXVNNI 1 /* client Intel from Alder Lake, AMD Zen 5: vpdpbusd on 256-bit registers, no AVX-512 */
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define SELFSPEC_NEON_DOT 1 /* ARMv8.2+ (Apple M1 on, Neoverse N1/V1 and later: Graviton 2-4, Ampere): sdot */
#include <arm_neon.h>
#endif

/* Which instructions the products below use: 1 VNNI (vpdpbusd), 2 AVX2 (vpmaddubsw + vpmaddwd: the same exact
 * integer sums in three instructions per 32 bytes, for CPUs without AVX-512 VNNI), 3 AVX-VNNI (AVX2's layout with
 * the sums by the 256-bit vpdpbusd: one instruction per 32 bytes), 4 ARM's sdot (NEON with the dot product
 * extension), 0 the portable loops (plain C written for the compiler's vectoriser).  All give bit-identical products.
 */
int selfspec_int8_kernels(void) {
#if defined(SELFSPEC_VNNI)
    return 1;
#elif defined(SELFSPEC_AVXVNNI)
    return 3;
#elif defined(SELFSPEC_AVX2)
    return 2;
#elif defined(SELFSPEC_NEON_DOT)
    return 4;
#else
    return 0;
#endif
}

/* Block b's scale d and its code sums s0 (elements 0-15) and s1 (16-31), where the products read them */
static inline void block_sums(long b, float d, int s0, int s1, float *dx, float *ds16, float *ds32, int32_t *xs16,
                              long S) {
    dx[b * S] = d;
    ds16[2 * b * S] = d * (float)s0;
    ds16[(2 * b + 1) * S] = d * (float)s1;
    ds32[b * S] = d * (float)(s0 + s1);
    xs16[2 * b * S] = s0;
    xs16[(2 * b + 1) * S] = s1;
}

/* One row of x [K] to int8 codes xq [K], block scales dx [K/32], and dx * (sum of the codes) per 16 (ds16) and
 * per 32 (ds32) elements: the minimum's term of a q8 group of 16 or of any group of 32; xs16: the sums of the
 * codes per 16 themselves (the AVX2 q8 products add 128 * sum to their own integer sums).  A block holding a NaN
 * gets a NaN scale and an infinite one a NaN product, so the products' outputs stay non-finite, as in fp32.
 * S: rows interleaved with this one (see QRUN): block b's 32 codes at xq + 32 S b, its scale at dx[S b], the
 * per-16 values at [S j] (S = 1: the row alone, contiguous). */
static void quantize_row_strided(long K, const float *x, int8_t *xq, float *dx, float *ds16, float *ds32,
                                 int32_t *xs16, long S) {
#ifdef SELFSPEC_VNNI
    /* the same numbers as the portable loop: max is exact, vcvtps2dq rounds half to even under the default mode */
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (long b = 0; b < K / 32; b++) {
        const __m512 a0 = _mm512_loadu_ps(x + b * 32), a1 = _mm512_loadu_ps(x + b * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a0), _mm512_andnot_ps(sign, a1)));
        const int nan = _mm512_cmp_ps_mask(a0, a0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a1, a1, _CMP_UNORD_Q);
        const float d = nan ? NAN : amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(inv)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(xq + b * S * 32), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + b * S * 32 + 16), _mm512_cvtepi32_epi8(q1));
        const int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        block_sums(b, d, s0, s1, dx, ds16, ds32, xs16, S);
    }
#elif defined(SELFSPEC_AVX2)
    /* the same numbers again, 8 lanes at a time: the scalar loop took a tenth of the AVX2 build's step */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long b = 0; b < K / 32; b++) {
        __m256 a[4];
        int nan = 0;
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_loadu_ps(x + b * 32 + 8 * j);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(a[j], a[j], _CMP_UNORD_Q));
        }
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const float d = nan ? NAN : amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], _mm256_set1_ps(inv)));
        /* |q| <= 127: the saturating packs are exact; they interleave 4-lane quarters, which `order` undoes */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * S * 32), _mm256_permutevar8x32_epi32(bytes, order));
        __m256i s01 = _mm256_add_epi32(q[0], q[1]), s23 = _mm256_add_epi32(q[2], q[3]); /* exact integers */
        __m256i both = _mm256_hadd_epi32(s01, s23); /* pairs: s01 in 0-1, 4-5; s23 in 2-3, 6-7 */
        both = _mm256_hadd_epi32(both, both);       /* s01 in 0, 4; s23 in 1, 5 */
        const int s0 = _mm256_extract_epi32(both, 0) + _mm256_extract_epi32(both, 4);
        const int s1 = _mm256_extract_epi32(both, 1) + _mm256_extract_epi32(both, 5);
        block_sums(b, d, s0, s1, dx, ds16, ds32, xs16, S);
    }
#else
    for (long b = 0; b < K / 32; b++) {
        const float *p = x + b * 32;
        float amax = 0.0f;
        int nan = 0;
        for (int i = 0; i < 32; i++) {
            amax = fmaxf(amax, fabsf(p[i]));
            nan |= isnan(p[i]);
        }
        const float d = nan ? NAN : amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            const int q = (int)nearbyintf(p[i] * inv); /* round half to even, as vcvtps2dq */
            xq[b * S * 32 + i] = (int8_t)q;
            sum[i >> 4] += q;
        }
        block_sums(b, d, sum[0], sum[1], dx, ds16, ds32, xs16, S);
    }
#endif
}

/* Rows of x quantised, as the products read them, in runs of QRUN rows (the last run: the rows left, S of them)
 * interleaved by blocks of 32: code k of row i of a run at q + run * QRUN * K + 32 S (k / 32) + 32 i + k % 32, its
 * block scale at dx + run * QRUN * K / 32 + S (k / 32) + i, and the per-16 values (ds16, xs16) likewise in S
 * columns.  The VNNI products take a run's rows together (BLOCK_RUN = QRUN): row t of a group is then a constant
 * offset from one pointer, where with rows apart each of the 8 rows kept three pointers, more than the
 * registers, which the compiler spilled and reloaded in the inner loop.  The other builds keep rows apart
 * (QRUN 1: the row-major layout). */
#ifdef SELFSPEC_VNNI
#define QRUN 8
#else
#define QRUN 1
#endif
typedef struct {
    const int8_t *q;
    const float *dx, *ds16, *ds32;
    const int32_t *xs16;
} qrows;

/* How far ahead (bytes of this thread's weight stream) the vector products prefetch: chosen per machine by timing
 * whole passes (core/native_tuning.py; on Zen 5 2-16 KB gave the same speed on the 262k-row head, none 2/3 of
 * it); 0 turns software prefetching off, for CPUs whose own prefetchers do better. */
static long prefetch_bytes = 4096;
void selfspec_set_int8_prefetch(long bytes) { prefetch_bytes = bytes < 0 ? 0 : bytes; }
long selfspec_int8_prefetch(void) { return prefetch_bytes; }

/* Which caches that prefetch fills, as __builtin_prefetch's locality: 0 non-temporal (prefetchnta: Zen's choice),
 * 1 the outer caches (prefetcht2), 3 every level (prefetcht0).  Chosen per machine by timing: on an Intel Xeon
 * (Sapphire Rapids) VM non-temporal prefetches halved the products' speed (a line fetched past L2 trains no L2
 * streamer) where t2 / t0 ones beat no prefetch by 8% (one-token pass) and 14% (5 rows). */
static int prefetch_hint = 0;
void selfspec_set_int8_prefetch_hint(int hint) { prefetch_hint = hint == 1 || hint == 3 ? hint : 0; }
int selfspec_int8_prefetch_hint(void) { return prefetch_hint; }
/* the branch on the run-time hint is taken the same way all pass long: predicted, a few instructions a group */
#define PREFETCH_W(hint, p)                                                                                           \
    do {                                                                                                              \
        if ((hint) == 3)                                                                                              \
            __builtin_prefetch((p), 0, 3);                                                                            \
        else if ((hint) == 1)                                                                                         \
            __builtin_prefetch((p), 0, 1);                                                                            \
        else                                                                                                          \
            __builtin_prefetch((p), 0, 0);                                                                            \
    } while (0)

/* Threads of a decoding pass (the fused stack, the int8 head): 0 = OpenMP's default.  Chosen per machine by
 * timing too: where the two "cores" are hyperthreads of one, or another process holds one, a second thread
 * adds barrier waits and no bandwidth. */
static int pass_threads = 0;
void selfspec_set_pass_threads(int n) { pass_threads = n < 0 ? 0 : n; }
int selfspec_pass_threads(void) { return pass_threads > 0 ? pass_threads : omp_get_max_threads(); }

/* Bytes of one group of G codes for 16 output rows in each form */
#define LUT4 12 /* a form's BITS for IQ4's indices (see the header) */
#define NIBBLES(BITS) ((BITS) == 4 || (BITS) == LUT4) /* the forms of 4-bit codes alone */
#define GROUP_BYTES(BITS, G)                                                                                          \
    ((BITS) == 4 || (BITS) == LUT4 ? 256                                                                             \
     : (BITS) == 2                 ? 64                                                                              \
     : (BITS) == 3                 ? 96                                                                              \
     : (BITS) == 5                 ? 320                                                                             \
     : (BITS) == 6                 ? 192                                                                             \
                                   : (G) * 16)
/* A symmetric form's minimum in units of d (-2^(BITS-1)), an integer: its term, SYM_MIN_INT * (the group's sum of
 * x's codes), joins the exact integer sum before the sum's one conversion to float, so a group of such a form costs
 * a row of x one multiply and one fused multiply-add (a form with stored minima: a second one for its minimum) */
#define SYM_MIN_INT(BITS) \
    ((BITS) == 2 ? -2 : (BITS) == 3 ? -4 : (BITS) == 4 ? -8 : (BITS) == 5 ? -16 : (BITS) == 6 ? -32 : -128)
/* IQ4's levels (llama.cpp's kvalues_iq4nl: -127, -104, ..., 113) + 128, the unsigned codes a LUT4 index picks */
static const uint8_t IQ4_CODES[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
#define X16_SCALE16 0x100 /* in a product's form: scales and minima are IEEE halves */
#define X16_SUB8 0x200    /* ... or K-quant sub-scales: a signed byte per group times a half per 256 weights */
/* A form's scale kind SK: 0 fp32, 1 halves, 2 sub-scales; bytes of one block's table of scales (or minima) */
#define SCALE_KIND(form) (((form) & X16_SUB8) ? 2 : ((form) & X16_SCALE16) ? 1 : 0)
#define SCALE_BYTES(SK) ((SK) == 2 ? 1 : (SK) ? 2 : 4) /* per group and row (sub-scales: the byte alone) */
#define SCALE_BLOCK_BYTES(SK, groups, K) ((groups) * 16 * SCALE_BYTES(SK) + ((SK) == 2 ? (K) / 256 * 32 : 0))

/* An IEEE half widened to a float (exact; the portable path's and the tail's conversion): its exponent and
 * mantissa bits moved into a float's place and scaled by 2^112 (exact for normal and subnormal halves: a power
 * of two; the all-ones exponent is taken to infinity or NaN apart).  Branch-free, so the portable loops vectorise. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, rest = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    memcpy(&f, &rest, sizeof f);
    f *= 0x1p112f;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits = (h & 0x7c00u) == 0x7c00u ? 0x7f800000u | rest : bits; /* infinity or NaN, payload kept */
    bits |= sign;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A sub-scale table's 16 halves (one per row) of the 256 weights holding group g (the block: `groups` groups of G) */
static inline const uint16_t *sub_halves(const void *p, long g, long groups, long G) {
    return (const uint16_t *)((const int8_t *)p + groups * 16) + (g * G / 256) * 16;
}

/* The scale (or minimum) of group g, row r of a block's table p of kind SK (the block has `groups` groups of G) */
static inline float scale_at(const void *p, long g, int r, int SK, long groups, long G) {
    if (SK == 2) {
        const uint16_t *d = sub_halves(p, g, groups, G);
        return (float)((const int8_t *)p)[g * 16 + r] * half_to_float(d[r]);
    }
    return SK ? half_to_float(((const uint16_t *)p)[g * 16 + r]) : ((const float *)p)[g * 16 + r];
}

void selfspec_rows_q4_one(long n, long K, const uint8_t *codes, const float *scale, const float *minv, float *out);
void selfspec_rows_q8_one(long n, long K, long G, const int8_t *codes, const float *scale, const float *minv,
                          float *out); /* quant_kernels.c: a row form's row decoded */

/* Group g of row i of block `block` of an interleaved copy as the row form holds it, at row: nibbles (BITS 4) or
 * bytes (8: code + 128 back to the code) as they lie, the compact forms' 5- and 6-bit codes (BITS 5, G 32: Q5_0,
 * Q5_1, Q5_K; BITS 6, G 16: Q6_K) as signed bytes (u, less 2^(BITS-1) where the form stores no minima) */
static void gather_group(int bits, long G, int minima, const uint8_t *codes, long block, long groups, long g, int i,
                         uint8_t *row) {
    if (bits == 4 || bits == 8) {
        const long J = bits == 4 ? 4 : G / 4;
        const uint8_t *src = codes + ((block * groups + g) * J * 16 + i) * 4;
        for (long j = 0; j < J; j++)
            for (int b = 0; b < 4; b++) {
                const uint8_t c = src[j * 64 + b];
                row[(g * J + j) * 4 + b] = bits == 4 ? c : (uint8_t)(c ^ 0x80);
            }
        return;
    }
    const long J = bits == 5 ? 4 : 2; /* 64-byte words of nibbles; then one of high bits */
    const int off = minima ? 0 : 1 << (bits - 1), per = bits - 4;
    const uint8_t *c = codes + (block * groups + g) * GROUP_BYTES(bits, G);
    uint8_t u[32];
    for (long j = 0; j < J; j++)
        for (int b = 0; b < 4; b++) {
            const uint8_t v = c[64 * j + 4 * i + b];
            u[4 * j + b] = v & 15;
            u[G / 2 + 4 * j + b] = v >> 4;
        }
    for (int b = 0; b < 4; b++) {
        const uint8_t h = c[64 * J + 4 * i + b];
        for (long j = 0; j < G / 4; j++) u[4 * j + b] |= (uint8_t)(((h >> (per * j)) & ((1 << per) - 1)) << 4);
    }
    for (long k = 0; k < G; k++) row[g * G + k] = (uint8_t)(int8_t)(u[k] - off);
}

/* out [R, K] = the rows idx[0..R) of a weight whose row form was released, decoded from its interleaved copy (BITS
 * 4: nibbles, 8: bytes, 5 or 6: the compact forms; tables of kind sk: fp32, halves or sub-scales) bit for bit as
 * selfspec_rows_q4 / _q8 decode the row form: each row's codes, scales and minima are gathered into a row of its own
 * and decoded by that same code.  minv NULL: q4 symmetric (minimum -8 scale), the other forms without minima.  An
 * embedding lookup of a token not yet looked up (the tied tables of SmolLM2 and Gemma 3): ~2 us, where gathering
 * with numpy took 40-50 us; the compact forms' rows took numpy 12 ns a weight (2 s of the 3.4 that the 4-bit draft
 * copies of a 0.5B Q4_K_M file's 5- and 6-bit tensors took).  Returns 0, -1 (out untouched) where its scratch could
 * not be had, -2 for a form it does not take: byte or nibble codes with sub-scales, a q8 copy's minima (its table
 * holds m - 128 d), the 2-, 3-bit and IQ4 forms. */
int selfspec_rows_x16(long R, const int64_t *idx, long K, long G, int bits, int sk, const uint8_t *codes,
                      const void *scale, const void *minv, float *out) {
    const int takes = bits == 4 || bits == 8 ? sk < 2 && (bits == 4 || !minv)
                                             : (bits == 5 && G == 32) || (bits == 6 && G == 16);
    if (!takes || sk < 0 || sk > 2) return -2;
    const long groups = K / G, table_bytes = SCALE_BLOCK_BYTES(sk, groups, K);
    uint8_t *row = malloc((size_t)(bits == 4 ? K / 2 : K));
    float *sc = malloc(2 * (size_t)groups * sizeof(float));
    if (!row || !sc) {
        free(row);
        free(sc);
        return -1;
    }
    float *mn = sc + groups;
    for (long r = 0; r < R; r++) {
        const long block = idx[r] / 16;
        const int i = (int)(idx[r] % 16);
        const char *st = (const char *)scale + block * table_bytes;
        const char *mt = minv ? (const char *)minv + block * table_bytes : 0;
        for (long g = 0; g < groups; g++) {
            gather_group(bits, G, minv != 0, codes, block, groups, g, i, row);
            sc[g] = scale_at(st, g, i, sk, groups, G);
            mn[g] = mt ? scale_at(mt, g, i, sk, groups, G) : (bits == 4 ? sc[g] * -8.0f : 0.0f);
        }
        if (bits == 4)
            selfspec_rows_q4_one(0, K, row, sc, mn, out + r * K);
        else
            selfspec_rows_q8_one(0, K, G, (const int8_t *)row, sc, minv ? mn : 0, out + r * K);
    }
    free(row);
    free(sc);
    return 0;
}

/* Small loops of a constant count (words of a group, rows of a run) unrolled whole, so that their arrays of vectors
 * stay in registers: left to the compiler's heuristics in the one big function that inlines every form, GCC kept
 * them as loops over stack arrays (a group's decoded words stored and reloaded, twice the instructions) */
#define UNROLL _Pragma("GCC unroll 16")

#ifdef SELFSPEC_VNNI

/* The 16 scales or minima of group g (see scale_at): fp32, halves widened by vcvtph2ps, or sub-scales (signed
 * bytes widened, times their widened half: exact) */
static inline __attribute__((always_inline)) __m512 scales16(const void *p, long g, const int SK, long groups,
                                                             long G) {
    if (SK == 2) {
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p
                                                                                                   + g * 16))));
        const uint16_t *d = sub_halves(p, g, groups, G);
        return _mm512_mul_ps(sc, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d)));
    }
    return SK ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + g * 16)))
              : _mm512_loadu_ps((const float *)p + g * 16);
}

/* A compact group's codes (c: its first byte) as the 64-byte words w[j] (k = 4j + i): the nibbles with the high
 * group's bits of word j (BITS 5: bit j; BITS 6: bits 2j, 2j + 1) moved to bit 4 (and 5), one ternary-logic
 * instruction (0xF8: a | b & c) a word */
static inline __attribute__((always_inline)) void decode_compact512(const int BITS, const uint8_t *c, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(15);
    const int J = BITS == 5 ? 4 : 2; /* 64-byte groups of nibbles */
    const __m512i hb = _mm512_loadu_si512(c + 64 * J), mask = _mm512_set1_epi8(BITS == 5 ? 0x10 : 0x30);
    __m512i h[8];
    UNROLL
    for (int j = 0; j < 2 * J; j++) {
        const int shift = 4 - (BITS - 4) * j; /* left by shift, or right by -shift: bits only move within a byte */
        h[j] = shift > 0 ? _mm512_slli_epi16(hb, shift) : shift < 0 ? _mm512_srli_epi16(hb, -shift) : hb;
    }
    UNROLL
    for (int j = 0; j < J; j++) {
        const __m512i v = _mm512_loadu_si512(c + 64 * j);
        w[j] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low), h[j], mask, 0xF8);
        w[j + J] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), h[j + J], mask, 0xF8);
    }
}

/* A nibble group's codes (c: its first byte; BITS 4 or LUT4) as the words w[j] (k = 4j + i): the low nibbles of
 * each 64-byte group, then the high ones; LUT4's indices looked up (vpshufb within each 16-byte lane) */
static inline __attribute__((always_inline)) void decode_nibbles512(const int BITS, const uint8_t *c, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(15);
    UNROLL
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(c + 64 * j);
        w[j] = _mm512_and_si512(v, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if (BITS == LUT4) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_CODES));
        UNROLL
        for (int j = 0; j < 8; j++) w[j] = _mm512_shuffle_epi8(table, w[j]);
    }
}

/* A 2- or 3-bit group's codes (c: its first byte) as the words w[j] (k = 4j + i): the two-bit fields of word j,
 * and for BITS 3 the third bits (the upper 32 bytes, rows 8-15, take theirs from bits 4-7) moved to bit 2 */
static inline __attribute__((always_inline)) void decode_low512(const int BITS, const uint8_t *c, __m512i w[4]) {
    const __m512i v = _mm512_loadu_si512(c), three = _mm512_set1_epi8(3);
    UNROLL
    for (int j = 0; j < 4; j++) w[j] = _mm512_and_si512(j ? _mm512_srli_epi16(v, 2 * j) : v, three);
    if (BITS == 3) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(c + 64));
        const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
        const __m512i four = _mm512_set1_epi8(4);
        UNROLL
        for (int j = 0; j < 4; j++) { /* bit j to bit 2: bits only move within a byte once masked */
            const __m512i t = j < 2 ? _mm512_slli_epi16(hb, 2 - j) : j > 2 ? _mm512_srli_epi16(hb, j - 2) : hb;
            w[j] = _mm512_ternarylogic_epi32(w[j], t, four, 0xF8);
        }
    }
}

/* acc + the products of the unsigned bytes of w with the 4 signed bytes at x (one word, broadcast), by vpdpbusd with
 * the word as its memory operand broadcast ({1to16}): GCC broadcast each word into a register by a separate
 * instruction first, one more instruction for the vector units per vpdpbusd */
static inline __attribute__((always_inline)) __m512i dpbusd_word(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* NB (1..8) rows of x against one block of 16 output rows; y [t * ldy + r] for r < 16.  BITS and G are
 * constants after inlining (4 and 32, or 8 and 16 or 32).  xq, dx: one run of NB interleaved rows' codes and block
 * scales (see qrows: [K/32][NB][32] and [K/32][NB]); ds: dx * code sums per weight group, [K/G][NB]. */
static inline __attribute__((always_inline)) void block_vnni(const int NB, const int BITS, const long G,
                                                             const int SYM, const int SK, long K,
                                                             const int8_t *xq, const float *dx, const float *ds,
                                                             const int32_t *xs, const uint8_t *codes,
                                                             const void *scale,
                                                             const void *minv, const float *bias, float *y,
                                                             long ldy) {
    const long groups = K / G;
    __m512 acc[8];
    UNROLL
    for (int t = 0; t < NB; t++) acc[t] = _mm512_setzero_ps();
    const long group_bytes = GROUP_BYTES(BITS, G), ahead = prefetch_bytes / group_bytes;
    const int hint = prefetch_hint;
    for (long g = 0; g < groups; g++) {
        /* the weights prefetch_bytes ahead in this thread's stream (its blocks are consecutive): a share of a
         * product is too short a stream for the hardware prefetcher, which alone read the head at 2/3 the speed */
        if (ahead) {
            UNROLL
            for (long b = 0; b < group_bytes; b += 64) PREFETCH_W(hint, codes + (g + ahead) * group_bytes + b);
            PREFETCH_W(hint, (const char *)scale + (g + ahead) * 16 * SCALE_BYTES(SK));
            if (!SYM) PREFETCH_W(hint, (const char *)minv + (g + ahead) * 16 * SCALE_BYTES(SK));
        }
        __m512i w[8];
        if (NIBBLES(BITS)) {
            decode_nibbles512(BITS, codes + g * GROUP_BYTES(BITS, G), w);
        } else if (BITS == 2 || BITS == 3) {
            decode_low512(BITS, codes + g * GROUP_BYTES(BITS, G), w);
        } else if (BITS == 5 || BITS == 6) {
            decode_compact512(BITS, codes + g * GROUP_BYTES(BITS, G), w);
        } /* q8: its bytes are read where they are multiplied (below); copied into w, the loop was compiled as a
           * call of memcpy per group (a tenth of a Qwen2.5 step, in its Q8_0 head) */
        const uint8_t *c8 = codes + g * G * 16;
        const __m512 dv = scales16(scale, g, SK, groups, G);
        const __m512 mv = SYM ? _mm512_setzero_ps() : scales16(minv, g, SK, groups, G);
        UNROLL
        for (int t = 0; t < NB; t++) {
            /* the run's rows interleaved (QRUN = NB rows, or the rows left): row t at a constant offset */
            const int32_t *xg = (const int32_t *)(xq + (g * G) / 32 * (NB * 32) + t * 32 + (g * G) % 32);
            /* symmetric (no stored minimum): the minimum -2^(BITS-1) d times the group's code sum, in integers
             * (xs: the sums per 16, in the run's interleaved columns) */
            const int32_t xsum = !SYM ? 0 : G == 32 ? xs[2 * g * NB + t] + xs[(2 * g + 1) * NB + t] : xs[g * NB + t];
            __m512i s0 = _mm512_set1_epi32(SYM_MIN_INT(BITS) * xsum), s1 = _mm512_setzero_si512(); /* two chains: */
            UNROLL
            for (int j = 0; j < G / 4; j += 2) { /* integer sums are exact in any order (one chain: no faster) */
                const __m512i w0 = BITS == 8 ? _mm512_loadu_si512(c8 + 64 * j) : w[j];
                const __m512i w1 = BITS == 8 ? _mm512_loadu_si512(c8 + 64 * (j + 1)) : w[j + 1];
                s0 = dpbusd_word(s0, w0, xg + j);
                s1 = dpbusd_word(s1, w1, xg + j + 1);
            }
            const __m512i s = _mm512_add_epi32(s0, s1);
            const __m512 d = _mm512_mul_ps(dv, _mm512_set1_ps(dx[(g * G) / 32 * NB + t]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[t]);
            if (!SYM) acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ds[g * NB + t]), acc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < NB; t++) {
        __m512 r = acc[t];
        if (bias) r = _mm512_add_ps(r, _mm512_loadu_ps(bias));
        _mm512_storeu_ps(y + t * ldy, r);
    }
}

#endif

#ifdef SELFSPEC_AVX2
/* Word j of a group's codes: w[j] as decoded, or where raw (q8 bytes, words 64 apart) is given, read from there:
 * q8 words copied into an array first were compiled as a call of memcpy per group */
static inline __attribute__((always_inline)) __m256i word256(const __m256i *w, const uint8_t *raw, int j) {
    return raw ? _mm256_loadu_si256((const __m256i *)(raw + 64 * j)) : w[j];
}

/* The exact integer sums of one group for one row of x (xg: its int8 codes as 4-byte words) and 8 output rows:
 * q4 from the group's nibbles w[8] (k = 4j + i in w[j]); q8 from its bytes c (32 bytes per 4 k, 64 apart) */
#ifdef SELFSPEC_AVXVNNI
/* AVX-VNNI: the exact sums of NW words of codes (unsigned bytes, any of the forms) in two chains of vpdpbusd */
static inline __attribute__((always_inline)) __m256i dots_vnni256(const int NW, const __m256i *w, const uint8_t *raw,
                                                                  const int32_t *xg) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    UNROLL
    for (int j = 0; j < NW; j += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, word256(w, raw, j), _mm256_set1_epi32(xg[j]));
        s1 = _mm256_dpbusd_avx_epi32(s1, word256(w, raw, j + 1), _mm256_set1_epi32(xg[j + 1]));
    }
    return _mm256_add_epi32(s0, s1);
}
#endif

static inline __attribute__((always_inline)) __m256i sums_q4(const __m256i w[8], const int32_t *xg) {
#ifdef SELFSPEC_AVXVNNI
    return dots_vnni256(8, w, NULL, xg);
#else
    __m256i p = _mm256_setzero_si256(); /* 8 int16 pair sums of at most 3,810 each: their total stays below 32,767 */
    UNROLL
    for (int j = 0; j < 8; j++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xg[j])));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* q8 codes (code + 128) in NW words (word256: w[NW], or read from raw) (xsum: the group's sum of xq) */
static inline __attribute__((always_inline)) __m256i sums_bytes(const int NW, const __m256i *w, const uint8_t *raw,
                                                                 const int32_t *xg, int32_t xsum) {
#ifdef SELFSPEC_AVXVNNI
    (void)xsum; /* vpdpbusd takes the codes + 128 as they are */
    return dots_vnni256(NW, w, raw, xg);
#else
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones16 = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    UNROLL
    for (int j = 0; j < NW; j++) {
        const __m256i v = _mm256_xor_si256(word256(w, raw, j), flip);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v),
                                                                       _mm256_sign_epi8(_mm256_set1_epi32(xg[j]), v)),
                                                  ones16));
    }
    return _mm256_add_epi32(s, _mm256_set1_epi32(128 * xsum)); /* back to the codes + 128 */
#endif
}

static inline __attribute__((always_inline)) __m256i sums_q8(const long G, const uint8_t *c, const int32_t *xg,
                                                              int32_t xsum) {
    return sums_bytes(G / 4, NULL, c, xg, xsum);
}

/* The 8 scales or minima of rows 8h..8h+7 of group g, as scales16 (halves widened by F16C's vcvtph2ps) */
static inline __attribute__((always_inline)) __m256 scales8(const void *p, long g, int h, const int SK, long groups,
                                                            long G) {
    if (SK == 2) {
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p
                                                                                                   + g * 16 + 8 * h))));
        const uint16_t *d = sub_halves(p, g, groups, G) + 8 * h;
        return _mm256_mul_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)));
    }
    return SK ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + g * 16 + 8 * h)))
              : _mm256_loadu_ps((const float *)p + g * 16 + 8 * h);
}

/* The same for 5- and 6-bit codes (0..63) in NW words w[NW]: pair products reach 16,002, so two words add in int16 */
static inline __attribute__((always_inline)) __m256i sums_small(const int NW, const __m256i *w, const int32_t *xg) {
#ifdef SELFSPEC_AVXVNNI
    return dots_vnni256(NW, w, NULL, xg);
#else
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    UNROLL
    for (int j = 0; j < NW; j += 2) {
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xg[j])),
                                           _mm256_maddubs_epi16(w[j + 1], _mm256_set1_epi32(xg[j + 1])));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones16));
    }
    return s;
#endif
}

/* One half (c: its first byte) of a compact group's codes as words: the nibbles with the high group's bits of word j
 * (BITS 5: bit j; BITS 6: bits 2j, 2j + 1) moved into bits 4 (and 5) */
static inline __attribute__((always_inline)) void decode_compact(const int BITS, const uint8_t *c, __m256i w[8]) {
    const __m256i low = _mm256_set1_epi8(15);
    const int J = BITS == 5 ? 4 : 2; /* 64-byte groups of nibbles (this half: 32 bytes of each) */
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(c + 64 * J));
    const __m256i mask = _mm256_set1_epi8(BITS == 5 ? 0x10 : 0x30);
    __m256i h[8];
    UNROLL
    for (int j = 0; j < 2 * J; j++) {
        const int shift = 4 - (BITS - 4) * j; /* as decode_compact512 */
        h[j] = shift > 0 ? _mm256_slli_epi16(hb, shift) : shift < 0 ? _mm256_srli_epi16(hb, -shift) : hb;
    }
    UNROLL
    for (int j = 0; j < J; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * j));
        w[j] = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(h[j], mask));
        w[j + J] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_and_si256(h[j + J], mask));
    }
}

/* The AVX2 form of block_vnni: NB (1..BLOCK_RUN) rows of x against one block of 16 output rows, as two halves of
 * 8 rows (the first 32 bytes of a 64-byte code group hold rows 0-7, the next 32 rows 8-15), one half after the
 * other: its NB sums and a group's decoded nibbles then fit AVX2's 16 registers, and the nibbles are decoded once
 * for all NB rows of x (a block's codes, a few KB, stay in L1 for the second half).  vpmaddubsw multiplies
 * unsigned by signed bytes and adds pairs into int16 with saturation, so each form keeps its pair sums in range:
 * q4 codes (0..15) times xq (-127..127) reach 3,810; a q8 code is stored as code + 128 (0..255), which could
 * reach 64,770, so it is taken as the signed code c (flip the top bit) whose magnitude |c| <= 128 meets xq with
 * c's sign moved onto it (pairs <= 32,512), and 128 * sum(xq) is added back (xs: quantize_row's sums per 16):
 * the integer sum is then exactly
 * vpdpbusd's, and each lane's float operations are block_vnni's in the same order, so the products are
 * bit-identical. */
static inline __attribute__((always_inline)) void block_avx2(const int NB, const int BITS, const long G,
                                                             const int SYM, const int SK, long K,
                                                             const int8_t *xq, const float *dx, const float *ds,
                                                             const int32_t *xs, const uint8_t *codes,
                                                             const void *scale,
                                                             const void *minv, const float *bias, float *y,
                                                             long ldy) {
    const long groups = K / G;
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_CODES));
    const long group_bytes = GROUP_BYTES(BITS, G), ahead = prefetch_bytes / group_bytes; /* as block_vnni's */
    const int hint = prefetch_hint;
    for (int h = 0; h < 2; h++) { /* rows 8h .. 8h+7 */
        __m256 acc[8];             /* NB <= BLOCK_RUN = 4; sized for the shared switch's unreachable cases */
        UNROLL
        for (int t = 0; t < NB; t++) acc[t] = _mm256_setzero_ps();
        for (long g = 0; g < groups; g++) {
            if (ahead && h == 0)
                UNROLL
                for (long b = 0; b < group_bytes; b += 64)
                    PREFETCH_W(hint, codes + (g + ahead) * group_bytes + b);
            const uint8_t *c = codes + g * group_bytes + 32 * h;
            const __m256 dv = scales8(scale, g, h, SK, groups, G);
            const __m256 mv = SYM ? _mm256_setzero_ps() : scales8(minv, g, h, SK, groups, G);
            __m256i w[8];
            if (NIBBLES(BITS)) {
                UNROLL
                for (int j = 0; j < 4; j++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * j));
                    w[j] = _mm256_and_si256(v, low);
                    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                if (BITS == LUT4)
                    UNROLL
                    for (int j = 0; j < 8; j++) w[j] = _mm256_shuffle_epi8(table, w[j]);
            } else if (BITS == 2 || BITS == 3) { /* as decode_low512; this half's third bits: bits 4h .. 4h + 3 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)c), three = _mm256_set1_epi8(3);
                UNROLL
                for (int j = 0; j < 4; j++) w[j] = _mm256_and_si256(j ? _mm256_srli_epi16(v, 2 * j) : v, three);
                if (BITS == 3) {
                    __m256i hb = _mm256_loadu_si256((const __m256i *)(codes + g * group_bytes + 64));
                    if (h) hb = _mm256_srli_epi16(hb, 4);
                    const __m256i four = _mm256_set1_epi8(4);
                    UNROLL
                    for (int j = 0; j < 4; j++) {
                        const __m256i t = j < 2   ? _mm256_slli_epi16(hb, 2 - j)
                                          : j > 2 ? _mm256_srli_epi16(hb, j - 2)
                                                  : hb;
                        w[j] = _mm256_or_si256(w[j], _mm256_and_si256(t, four));
                    }
                }
            } else if (BITS == 5 || BITS == 6)
                decode_compact(BITS, c, w);
            UNROLL
            for (int t = 0; t < NB; t++) {
                const int32_t *xg = (const int32_t *)(xq + t * K + g * G);
                const int32_t *xst = xs + t * (K / 16) + (g * G) / 16; /* the group's code sums per 16 */
                const int32_t xsum = G == 32 ? xst[0] + xst[1] : xst[0];
                __m256i s = BITS == 4                               ? sums_q4(w, xg)
                            : BITS <= 3 || BITS == 5 || BITS == 6 ? sums_small(G / 4, w, xg)
                            : BITS == LUT4                          ? sums_bytes(8, w, NULL, xg, xsum)
                                                                    : sums_q8(G, c, xg, xsum);
                if (SYM) s = _mm256_add_epi32(s, _mm256_set1_epi32(SYM_MIN_INT(BITS) * xsum)); /* as block_vnni */
                const __m256 d = _mm256_mul_ps(dv, _mm256_set1_ps(dx[t * (K / 32) + (g * G) / 32]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[t]);
                if (!SYM) acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(ds[t * groups + g]), acc[t]);
            }
        }
        UNROLL
        for (int t = 0; t < NB; t++) {
            __m256 r = acc[t];
            if (bias) r = _mm256_add_ps(r, _mm256_loadu_ps(bias + 8 * h));
            _mm256_storeu_ps(y + t * ldy + 8 * h, r);
        }
    }
}

#endif

#if defined(SELFSPEC_VNNI) || defined(SELFSPEC_AVX2)
#ifdef SELFSPEC_VNNI
#define BLOCK_KERNEL block_vnni
#define BLOCK_RUN 8 /* rows per weight pass: 8 accumulators of 16 lanes */
_Static_assert(BLOCK_RUN == QRUN, "the VNNI products take the quantised rows' runs whole");
#else
#define BLOCK_KERNEL block_avx2
#define BLOCK_RUN 4 /* 4 rows x 2 halves of 8 lanes: the 16 vector registers */
#endif

/* rows t0.. of x (NB of them) against one block, for one (BITS, G) */
#define BLOCK(NB, BITS, G, SYM, SK) \
    BLOCK_KERNEL(NB, BITS, G, SYM, SK, K, x->q + t0 * K, x->dx + t0 * (K / 32), \
                 ((G) == 32 ? x->ds32 + t0 * (K / 32) : x->ds16 + t0 * (K / 16)), x->xs16 + t0 * (K / 16), c, s, \
                 m, bb, yb + t0 * N, N)

/* All T rows of x against one block of 16 output rows, in runs of up to BLOCK_RUN rows */
#define BLOCK_ROWS(BITS, G, SYM, SK)                                                  \
    do {                                                                               \
        long t0 = 0;                                                                   \
        for (; t0 + BLOCK_RUN <= T; t0 += BLOCK_RUN) BLOCK(BLOCK_RUN, BITS, G, SYM, SK); \
        switch (T - t0) {                                                              \
            case 7: BLOCK(7, BITS, G, SYM, SK); break;                                \
            case 6: BLOCK(6, BITS, G, SYM, SK); break;                                \
            case 5: BLOCK(5, BITS, G, SYM, SK); break;                                \
            case 4: BLOCK(4, BITS, G, SYM, SK); break;                                \
            case 3: BLOCK(3, BITS, G, SYM, SK); break;                                \
            case 2: BLOCK(2, BITS, G, SYM, SK); break;                                \
            case 1: BLOCK(1, BITS, G, SYM, SK); break;                                \
            default: break;                                                            \
        }                                                                              \
    } while (0)

/* The same for a form that may hold its scales as halves or fp32 (sk 1 or 0) */
#define BLOCK_ROWS_S16(BITS, G, SYM)       \
    do {                                   \
        if (sk)                            \
            BLOCK_ROWS(BITS, G, SYM, 1);   \
        else                               \
            BLOCK_ROWS(BITS, G, SYM, 0);   \
    } while (0)
#endif

/* The portable form of the same arithmetic, written for the compiler's vectoriser (NEON on ARM, SSE on old x86):
 * a group's codes of the 16 rows are first decoded to bytes in the x16 order (byte 64j + 4r + i: code k = 4j + i of
 * row r), once for up to PORTABLE_ROWS rows of x, whose exact integer sums then run over straight byte arrays. */
#define PORTABLE_ROWS 8

static inline void decode_group_portable(int bits, long G, const uint8_t *codes, long g, uint8_t *w) {
    if (NIBBLES(bits)) {
        const uint8_t *c = codes + g * 256;
        for (int l = 0; l < 256; l++) w[l] = c[l] & 15;
        for (int l = 0; l < 256; l++) w[256 + l] = c[l] >> 4;
        if (bits == LUT4)
            for (int l = 0; l < 512; l++) w[l] = IQ4_CODES[w[l]];
    } else if (bits == 2 || bits == 3) { /* byte l = 4r + i of word j; rows 8-15 (l >= 32) keep bits 4-7 */
        const uint8_t *c = codes + g * GROUP_BYTES(bits, 16);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 64; l++)
                w[64 * j + l] = (uint8_t)(((c[l] >> (2 * j)) & 3)
                                          | (bits == 3 ? ((c[64 + (l & 31)] >> (j + 4 * (l >> 5))) & 1) << 2 : 0));
    } else if (bits == 5) {
        const uint8_t *c = codes + g * 320;
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 64; l++)
                w[64 * j + l] = (uint8_t)((j < 4 ? c[64 * j + l] & 15 : c[64 * (j - 4) + l] >> 4)
                                          | ((c[256 + l] >> j) & 1) << 4);
    } else if (bits == 6) {
        const uint8_t *c = codes + g * 192;
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 64; l++)
                w[64 * j + l] = (uint8_t)((j < 2 ? c[64 * j + l] & 15 : c[64 * (j - 2) + l] >> 4)
                                          | ((c[128 + l] >> (2 * j)) & 3) << 4);
    } else {
        memcpy(w, codes + g * G * 16, (size_t)G * 16);
    }
}

/* The exact integer sums s[r] = sum_k code(r, k) * xg[k] of one group (w: decode_group_portable's bytes).  Codes of
 * up to 6 bits: four products (|code| < 64, |x| <= 127) sum within 16 bits, so the vectoriser may use 16-bit
 * lanes for them. */
static inline void group_sums_portable(int bits, long G, const uint8_t *w, const int8_t *xg, int32_t xsum,
                                       int32_t s[16]) {
#ifdef SELFSPEC_NEON_DOT
    /* sdot: each 32-bit lane of a quad of rows takes 4 byte products with one word of x (the lane picked from a
     * register of 4 words), as vpdpbusd does; sdot multiplies signed bytes, so q8 codes (code + 128) are taken as
     * the signed codes (flip the top bit) and 128 * sum(x) is added back: the same exact integers */
    int32x4_t a[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    const int q8 = bits == 8 || bits == LUT4; /* codes + 128 */
    const uint8x16_t flip = vdupq_n_u8(q8 ? 0x80 : 0);
    for (long j4 = 0; j4 < G / 4; j4 += 4) {
        const int8x16_t x = vld1q_s8(xg + 4 * j4);
#define SELFSPEC_DOT_WORD(LANE)                                                                      \
    for (int q = 0; q < 4; q++)                                                                      \
        a[q] = vdotq_laneq_s32(a[q], vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w + 64 * (j4 + LANE) + 16 * q), flip)), \
                               x, LANE)
        SELFSPEC_DOT_WORD(0);
        SELFSPEC_DOT_WORD(1);
        SELFSPEC_DOT_WORD(2);
        SELFSPEC_DOT_WORD(3);
#undef SELFSPEC_DOT_WORD
    }
    const int32x4_t back = vdupq_n_s32(q8 ? 128 * xsum : 0);
    for (int q = 0; q < 4; q++) vst1q_s32(s + 4 * q, vaddq_s32(a[q], back));
#else
    (void)xsum;
    for (int r = 0; r < 16; r++) s[r] = 0;
    for (long j = 0; j < G / 4; j++) {
        const int32_t x0 = xg[4 * j], x1 = xg[4 * j + 1], x2 = xg[4 * j + 2], x3 = xg[4 * j + 3];
        const uint8_t *wj = w + 64 * j;
        if (bits <= 6)
            for (int r = 0; r < 16; r++)
                s[r] += (int16_t)(wj[4 * r] * x0 + wj[4 * r + 1] * x1 + wj[4 * r + 2] * x2 + wj[4 * r + 3] * x3);
        else
            for (int r = 0; r < 16; r++)
                s[r] += wj[4 * r] * x0 + wj[4 * r + 1] * x1 + wj[4 * r + 2] * x2 + wj[4 * r + 3] * x3;
    }
#endif
}

/* Rows t0 .. t0 + nt - 1 (nt <= PORTABLE_ROWS) of y against one block of 16 output rows (y: the block's first
 * column, rows ldy apart) */
static __attribute__((unused)) void block_portable(int bits, int sk, long K, long G, const qrows *x, long t0, int nt,
                                                  const uint8_t *codes, const void *scale, const void *minv,
                                                  const float *bias, float *y, long ldy) {
    float acc[PORTABLE_ROWS][16] = {{0}};
    uint8_t w[512];
    const long groups = K / G;
    for (long g = 0; g < groups; g++) {
        decode_group_portable(bits, G, codes, g, w);
        float d[16], m[16];
        for (int r = 0; r < 16; r++) {
            d[r] = scale_at(scale, g, r, sk, groups, G);
            m[r] = minv ? scale_at(minv, g, r, sk, groups, G) : 0.0f;
        }
        for (int t = 0; t < nt; t++) {
            const long row = t0 + t;
            int32_t s[16];
            const int32_t *xs = x->xs16 + row * (K / 16) + (g * G) / 16; /* the group's code sums per 16 */
            const int32_t xsum = G == 32 ? xs[0] + xs[1] : xs[0];
            group_sums_portable(bits, G, w, x->q + row * K + g * G, xsum, s);
            const float dxg = x->dx[row * (K / 32) + (g * G) / 32];
            const float dsg = G == 32 ? x->ds32[row * (K / 32) + g] : x->ds16[row * (K / 16) + g];
            for (int r = 0; r < 16; r++) { /* as block_vnni: a symmetric form's minimum in the integer sum */
                acc[t][r] = fmaf((float)(minv ? s[r] : s[r] + SYM_MIN_INT(bits) * xsum), d[r] * dxg, acc[t][r]);
                if (minv) acc[t][r] = fmaf(m[r], dsg, acc[t][r]);
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < 16; r++) y[(t0 + t) * ldy + r] = bias ? acc[t][r] + bias[r] : acc[t][r];
}

/* How a product's blocks of 16 output rows are shared between a pass's threads: 0 = in equal consecutive shares
 * (one long weight stream a thread, no coordination), n > 0 = taken n blocks at a time by whichever thread is
 * free (an atomic counter a chunk), n < 0 = guided (long shares first, shrinking to -n blocks).  Chosen per machine by timing passes (core/native_tuning.py): where a thread
 * is slowed now and then (a VM's vCPU preempted, an efficiency core, a sibling hyperthread's load) equal shares
 * leave the other waiting at the next barrier; where threads run evenly the shared counter only costs. */
static long split_blocks = 0;
void selfspec_set_int8_split(long blocks) { split_blocks = blocks; }
long selfspec_int8_split(void) { return split_blocks; }

/* Output rows nb * 16 .. + 15 of y [T, N] = x @ W.T (+ bias) for an x16 weight (see linear_x16_ws) */
static __attribute__((noinline)) void x16_block(int bits, int sk, long nb, long block_bytes, long table, long T,
                                                long N, long K, long G, const qrows *x, const uint8_t *codes,
                                                const void *scale, const void *minv, const float *bias, float *y) {
    const uint8_t *c = codes + nb * block_bytes;
    const void *s = (const char *)scale + nb * table;
    const void *m = minv ? (const char *)minv + nb * table : NULL;
    const float *bb = bias ? bias + nb * 16 : NULL;
#if defined(SELFSPEC_VNNI) || defined(SELFSPEC_AVX2)
    float *yb = y + nb * 16; /* this block's first output column: BLOCK writes rows of it */
    if (bits == 2 && sk == 2)
        BLOCK_ROWS(2, 16, 0, 2); /* Q2_K: its sub-scales and minima */
    else if (bits == 2)
        BLOCK_ROWS(2, 16, 0, 0);
    else if (bits == 3 && sk == 2)
        BLOCK_ROWS(3, 16, 1, 2); /* Q3_K */
    else if (bits == 3)
        BLOCK_ROWS(3, 16, 1, 0);
    else if (bits == LUT4 && sk == 2)
        BLOCK_ROWS(LUT4, 32, 1, 2); /* IQ4_XS */
    else if (bits == LUT4)
        BLOCK_ROWS_S16(LUT4, 32, 1); /* IQ4_NL */
    else if (sk == 2 && bits == 4)
        BLOCK_ROWS(4, 32, 0, 2); /* sub-scales: the K-quants' forms (Q4_K, Q5_K with minima; Q6_K without) */
    else if (sk == 2 && bits == 5)
        BLOCK_ROWS(5, 32, 0, 2);
    else if (sk == 2)
        BLOCK_ROWS(6, 16, 1, 2);
    else if (bits == 4 && m)
        BLOCK_ROWS_S16(4, 32, 0);
    else if (bits == 4)
        BLOCK_ROWS_S16(4, 32, 1);
    else if (bits == 5 && m)
        BLOCK_ROWS_S16(5, 32, 0);
    else if (bits == 5)
        BLOCK_ROWS_S16(5, 32, 1);
    else if (bits == 6)
        BLOCK_ROWS(6, 16, 1, 0);
    else if (G == 32 && m)
        BLOCK_ROWS(8, 32, 0, 0);
    else if (G == 32)
        BLOCK_ROWS_S16(8, 32, 1);
    else if (m)
        BLOCK_ROWS(8, 16, 0, 0);
    else
        BLOCK_ROWS(8, 16, 1, 0);
#else
    for (long t0 = 0; t0 < T; t0 += PORTABLE_ROWS)
        block_portable(bits, sk, K, G, x, t0, (int)(T - t0 < PORTABLE_ROWS ? T - t0 : PORTABLE_ROWS), c, s, m, bb,
                       y + nb * 16, N);
#endif
}

/* This thread's share of y [T, N] = x @ W.T (+ bias) for an x16 weight W [N, K] (N a multiple of 16), x already
 * quantised; inside a parallel region that every thread enters, no barrier at the end.  Which thread computes a
 * block changes no result (each block is computed whole by one thread, the same way). */
static void linear_x16_ws(int form, long T, long N, long K, long G, const qrows *x, const uint8_t *codes,
                          const void *scale, const void *minv, const float *bias, float *y) {
    const int bits = form & 0xff, sk = SCALE_KIND(form);
    const long groups = K / G, block_bytes = groups * GROUP_BYTES(bits, G), table = SCALE_BLOCK_BYTES(sk, groups, K);
    const long chunk = split_blocks; /* read once: every thread of a pass sees the value set between passes */
    if (chunk > 0) {
#pragma omp for schedule(dynamic, chunk) nowait
        for (long nb = 0; nb < N / 16; nb++)
            x16_block(bits, sk, nb, block_bytes, table, T, N, K, G, x, codes, scale, minv, bias, y);
    } else if (chunk < 0) {
        const long least = -chunk;
#pragma omp for schedule(guided, least) nowait
        for (long nb = 0; nb < N / 16; nb++)
            x16_block(bits, sk, nb, block_bytes, table, T, N, K, G, x, codes, scale, minv, bias, y);
    } else {
#pragma omp for schedule(static) nowait
        for (long nb = 0; nb < N / 16; nb++)
            x16_block(bits, sk, nb, block_bytes, table, T, N, K, G, x, codes, scale, minv, bias, y);
    }
}

/* Scratch for T quantised rows of K: xq, then dx, ds16, ds32 (floats), xs16 (int32) */
static long qrows_bytes(long T, long K) {
    return T * K + T * (K / 32 + K / 16 + K / 32 + K / 16) * (long)sizeof(float);
}

static qrows qrows_at(void *buf, long T, long K) {
    float *f = (float *)((char *)buf + ((T * K + 63) / 64) * 64);
    const qrows r = {(const int8_t *)buf, f, f + T * (K / 32), f + T * (K / 32 + K / 16),
                     (const int32_t *)(f + T * (K / 32 + K / 16 + K / 32))};
    return r;
}

/* Size of the scratch selfspec_quantize_rows_ws fills (rounded up to 64-byte lines) */
long selfspec_qrows_bytes(long T, long K) { return ((qrows_bytes(T, K) + 63) / 64 + 1) * 64; }

/* Blocks [b0, b1) of 32 of row t of x (x_t [K]) quantised into buf (selfspec_qrows_bytes(T, K) bytes), one
 * thread: a block's numbers do not depend on the others, so threads may share a row's blocks */
void selfspec_quantize_row_part(void *buf, long T, long K, long t, const float *x_t, long b0, long b1) {
    const qrows r = qrows_at(buf, T, K);
    const long run = t / QRUN * QRUN, i = t - run, S = T - run < QRUN ? T - run : QRUN;
    quantize_row_strided((b1 - b0) * 32, x_t + 32 * b0, (int8_t *)r.q + run * K + 32 * i + 32 * S * b0,
                         (float *)r.dx + run * (K / 32) + i + S * b0, (float *)r.ds16 + run * (K / 16) + i + 2 * S * b0,
                         (float *)r.ds32 + run * (K / 32) + i + S * b0,
                         (int32_t *)r.xs16 + run * (K / 16) + i + 2 * S * b0, S);
}

/* Row t of x (x_t [K]) quantised into buf (selfspec_qrows_bytes(T, K) bytes), one thread */
void selfspec_quantize_row_into(void *buf, long T, long K, long t, const float *x_t) {
    selfspec_quantize_row_part(buf, T, K, t, x_t, 0, K / 32);
}

/* This thread's share of quantising every row of x [T, K] into buf; a work-sharing loop with its closing barrier */
void selfspec_quantize_rows_ws(long T, long K, const float *x, void *buf) {
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) selfspec_quantize_row_into(buf, T, K, t, x + t * K);
}

/* y [T, N] = x @ W.T (+ bias) from rows already quantised into buf by selfspec_quantize_rows_ws (the fused stack) */
void selfspec_linear_x16_ws(int form, long T, long N, long K, long G, const void *buf, const uint8_t *codes,
                            const void *scale, const void *minv, const float *bias, float *y) {
    const qrows r = qrows_at((void *)buf, T, K);
    linear_x16_ws(form, T, N, K, G, &r, codes, scale, minv, bias, y);
}

/* y [T, N] = x [T, K] @ W.T (+ bias) for an x16 weight, x in fp32; form: bits per code | X16_SCALE16 for half
 * scales.  Returns 0, or -1 without scratch memory. */
int selfspec_linear_x16(int form, long T, long N, long K, long G, const float *x, const uint8_t *codes,
                        const void *scale, const void *minv, const float *bias, float *y) {
    void *buf = NULL;
    if (posix_memalign(&buf, 64, (size_t)selfspec_qrows_bytes(T, K))) return -1;
#pragma omp parallel if (T * N * K > (1L << 16)) num_threads(selfspec_pass_threads())
    {
        selfspec_quantize_rows_ws(T, K, x, buf);
        selfspec_linear_x16_ws(form, T, N, K, G, buf, codes, scale, minv, bias, y);
    }
    free(buf);
    return 0;
}
