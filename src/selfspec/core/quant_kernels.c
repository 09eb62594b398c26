/* selfspec's kernels for weights kept quantised (see quant.py, which builds and loads this file).
 *
 * Two storage formats cover the GGUF types we keep quantised; both decode a weight exactly as
 * w = scale[group] * q + min[group], the way the GGUF reference dequantiser does:
 *   q4: 4-bit codes, groups of 32; per group 16 bytes, byte j holds element j (low nibble) and
 *       element j + 16 (high nibble).  Q4_0, Q4_1, Q4_K.
 *   q8: one signed byte per code, groups of G (16 or 32).  Q8_0, Q5_0, Q5_1, Q5_K, Q6_K.
 * Products y[t, n] = sum_k x[t, k] * w[n, k] decode 16 weights at a time into fp32 and accumulate
 * 16 lanes per row with explicit fmaf; each output row is computed in the same order whatever the
 * number of rows T, so a token's logits do not depend on how many tokens share the pass (greedy
 * speculative decoding stays token-identical to one-token decoding).  Threads: OpenMP, which is
 * torch's own pool on Linux builds (the library is loaded after torch, whose libgomp it reuses).
 */
#include <math.h>
#include <stdint.h>

#define LANES 16

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
static inline vec v_zero(void) { return _mm512_setzero_ps(); }
static inline vec v_set1(float a) { return _mm512_set1_ps(a); }
static inline vec v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vec v_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline void v_store(float *p, vec a) { _mm512_storeu_ps(p, a); }
static inline vec v_u8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline vec v_i8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
/* the 16 low and 16 high nibbles of 16 bytes as floats */
static inline void v_nibbles(const uint8_t *c, vec *lo, vec *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)c), mask = _mm_set1_epi8(15);
    *lo = v_u8(_mm_and_si128(b, mask));
    *hi = v_u8(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}
static inline vec v_bytes(const int8_t *c) { return v_i8(_mm_loadu_si128((const __m128i *)c)); }
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: 16 lanes as two 8-lane halves, lane for lane the AVX-512 operations (a float32-activation step of the
 * AVX2 build ran 10x slower on the portable loops below) */
#define QUANT_AVX2 1
#include <immintrin.h>
typedef struct { __m256 lo, hi; } vec;
static inline vec v_zero(void) { const vec r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline vec v_set1(float a) { const vec r = {_mm256_set1_ps(a), _mm256_set1_ps(a)}; return r; }
static inline vec v_load(const float *p) { const vec r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline vec v_fma(vec a, vec b, vec c) {
    const vec r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
    return r;
}
static inline void v_store(float *p, vec a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline vec v_u8(__m128i b) {
    const vec r = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
    return r;
}
static inline void v_nibbles(const uint8_t *c, vec *lo, vec *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)c), mask = _mm_set1_epi8(15);
    *lo = v_u8(_mm_and_si128(b, mask));
    *hi = v_u8(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}
static inline vec v_bytes(const int8_t *c) {
    const __m128i b = _mm_loadu_si128((const __m128i *)c);
    const vec r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
    return r;
}
#else
/* portable fallback: 16 lanes as a plain struct, explicit fmaf (no reordering) */
typedef struct { float f[LANES]; } vec;
static inline vec v_zero(void) { vec r; for (int j = 0; j < LANES; j++) r.f[j] = 0.0f; return r; }
static inline vec v_set1(float a) { vec r; for (int j = 0; j < LANES; j++) r.f[j] = a; return r; }
static inline vec v_load(const float *p) { vec r; for (int j = 0; j < LANES; j++) r.f[j] = p[j]; return r; }
static inline vec v_fma(vec a, vec b, vec c) {
    vec r; for (int j = 0; j < LANES; j++) r.f[j] = fmaf(a.f[j], b.f[j], c.f[j]); return r;
}
static inline void v_store(float *p, vec a) { for (int j = 0; j < LANES; j++) p[j] = a.f[j]; }
static inline void v_nibbles(const uint8_t *c, vec *lo, vec *hi) {
    for (int j = 0; j < LANES; j++) { lo->f[j] = (float)(c[j] & 15); hi->f[j] = (float)(c[j] >> 4); }
}
static inline vec v_bytes(const int8_t *c) { vec r; for (int j = 0; j < LANES; j++) r.f[j] = (float)c[j]; return r; }
#endif

/* The sum of a + b's 16 lanes by a fixed tree, lanes l and l + w added for w = 8, 4, 2, 1 (the same rounding for
 * every row and every T, and in every build; spelt out, as compilers' _mm512_reduce_add_ps need not keep it) */
#if defined(__AVX512F__)
static inline float v_sum2(vec a, vec b) {
    const __m512 v = _mm512_add_ps(a, b);
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));  /* l + l+8 */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));            /* l + l+4 */
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                                    /* l + l+2 */
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));                                   /* l + l+1 */
}
#elif defined(QUANT_AVX2)
static inline float v_sum2(vec a, vec b) {
    const __m256 h = _mm256_add_ps(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); /* l + l+8 */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));          /* l + l+4 */
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                                  /* l + l+2 */
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));                                 /* l + l+1 */
}
#else
static inline float v_sum2(vec a, vec b) {
    float ta[LANES], tb[LANES];
    v_store(ta, a);
    v_store(tb, b);
    for (int j = 0; j < LANES; j++) ta[j] = ta[j] + tb[j];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) ta[l] = ta[l] + ta[l + w];
    return ta[0];
}
#endif

/* The 32 weights of one group of one row, decoded (w0: elements 0..15, w1: 16..31). */
#if defined(__AVX512F__)
/* The 16 possible values scale * q + min (q = 0..15) computed once, then looked up by code with a permute:
 * 8 instructions per group instead of 12 (what bounds a one-row q4 product), the very same fma results. */
static inline void decode_q4(const uint8_t *codes, const float *scale, const float *minv, long group, vec *w0,
                             vec *w1) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(scale[group]), iota, _mm512_set1_ps(minv[group]));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + group * 16)));
    *w0 = _mm512_permutexvar_ps(b, table);  /* vpermps reads the low 4 bits of each index: the low nibble */
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
#else
static inline void decode_q4(const uint8_t *codes, const float *scale, const float *minv, long group, vec *w0,
                             vec *w1) {
    vec lo, hi;
    v_nibbles(codes + group * 16, &lo, &hi);
    const vec s = v_set1(scale[group]), m = v_set1(minv[group]);
    *w0 = v_fma(s, lo, m);
    *w1 = v_fma(s, hi, m);
}
#endif

static inline vec decode_q8(const int8_t *codes, const float *scale, const float *minv, int group_shift,
                            long chunk) {
    const long g = chunk >> group_shift;  /* groups of 16 << group_shift weights */
    return v_fma(v_set1(scale[g]), v_bytes(codes + chunk * LANES), v_set1(minv ? minv[g] : 0.0f));
}

/* One output row for NB (1..8, a constant after inlining) rows of x at once.  Each row of x keeps two
 * accumulators (the low and high 16 weights of a group of 32), added in a fixed order at the end: the same
 * arithmetic for every NB, so a row's result does not depend on how many rows share the call. */
static inline __attribute__((always_inline)) void row_q4(int NB, long K, const float *x, float *y, long ldy,
                                                         const uint8_t *codes, const float *scale,
                                                         const float *minv) {
    vec acc0[8], acc1[8];
    for (int t = 0; t < 8; t++) acc0[t] = acc1[t] = v_zero();
    for (long g = 0; g < K / 32; g++) {
        vec w0, w1;
        decode_q4(codes, scale, minv, g, &w0, &w1);
        for (int t = 0; t < NB; t++) {
            const float *xg = x + t * K + g * 32;
            acc0[t] = v_fma(w0, v_load(xg), acc0[t]);
            acc1[t] = v_fma(w1, v_load(xg + LANES), acc1[t]);
        }
    }
    for (int t = 0; t < NB; t++) y[t * ldy] = v_sum2(acc0[t], acc1[t]);
}

static inline __attribute__((always_inline)) void row_q8(int NB, long K, const float *x, float *y, long ldy,
                                                         const int8_t *codes, const float *scale,
                                                         const float *minv, int group_shift) {
    vec acc0[8], acc1[8];
    for (int t = 0; t < 8; t++) acc0[t] = acc1[t] = v_zero();
    for (long c = 0; c < K / LANES; c += 2) {  /* K is a multiple of 32 */
        const vec w0 = decode_q8(codes, scale, minv, group_shift, c);
        const vec w1 = decode_q8(codes, scale, minv, group_shift, c + 1);
        for (int t = 0; t < NB; t++) {
            const float *xc = x + t * K + c * LANES;
            acc0[t] = v_fma(w0, v_load(xc), acc0[t]);
            acc1[t] = v_fma(w1, v_load(xc + LANES), acc1[t]);
        }
    }
    for (int t = 0; t < NB; t++) y[t * ldy] = v_sum2(acc0[t], acc1[t]);
}

#define ROW_BLOCKS(ROW, ...)                                                            \
    long t = 0;                                                                         \
    for (; t + 8 <= T; t += 8) ROW(8, K, x + t * K, y + t * N + n, N, __VA_ARGS__);     \
    switch (T - t) {                                                                    \
        case 7: ROW(7, K, x + t * K, y + t * N + n, N, __VA_ARGS__); break;             \
        case 6: ROW(6, K, x + t * K, y + t * N + n, N, __VA_ARGS__); break;             \
        case 5: ROW(5, K, x + t * K, y + t * N + n, N, __VA_ARGS__); break;             \
        case 4: ROW(4, K, x + t * K, y + t * N + n, N, __VA_ARGS__); break;             \
        case 3: ROW(3, K, x + t * K, y + t * N + n, N, __VA_ARGS__); break;             \
        case 2: ROW(2, K, x + t * K, y + t * N + n, N, __VA_ARGS__); break;             \
        case 1: ROW(1, K, x + t * K, y + t * N + n, N, __VA_ARGS__); break;             \
        default: break;                                                                 \
    }

/* The weights of output row n + PREFETCH_ROWS asked for while row n is computed: each product is small (a few
 * hundred KB per thread) and the hardware prefetcher would first need several misses of it to start.  Addresses
 * past the end are only hints (prefetches never fault). */
#define PREFETCH_ROWS 6
static inline void prefetch_row(const void *codes, long code_bytes, const float *scale, const float *minv,
                                long groups) {
    for (long b = 0; b < code_bytes; b += 64) __builtin_prefetch((const char *)codes + b, 0, 0);
    for (long b = 0; b < groups * (long)sizeof(float); b += 64) {
        __builtin_prefetch((const char *)scale + b, 0, 0);
        if (minv) __builtin_prefetch((const char *)minv + b, 0, 0);
    }
}

/* Every output row reads all rows of x it is given: while they fit in the L1 data cache (X_L1_BYTES), one pass
 * over the weights serves all T rows; beyond, the rows go in passes of as many as fit (a product of 16 rows of
 * x [16, 1536] read them from L2 at half the speed).  The static schedule gives each thread the same output
 * rows in every pass, so its weights stay in its own L2. */
#define X_L1_BYTES (48 * 1024)
static inline long x_rows_per_pass(long T, long K) {
    const long fit = X_L1_BYTES / (K * (long)sizeof(float));
    return T <= fit ? T : (fit < 1 ? 1 : fit);
}

/* 1 when these kernels are the AVX-512 build (fast enough to compute the prompt too), 0 for the portable loops */
int selfspec_vector_kernels(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* One pass: y [T, N] = x [T, K] @ W.T (+ bias), this thread's share of the output rows; bits 4 (q4 codes) or 8
 * (q8 codes in groups of 16 << group_shift) -- constant in a call, so the branch costs nothing. */
static inline void linear_pass(int bits, long T, long N, long K, int group_shift, const float *x, const void *codes,
                               const float *scale, const float *minv, const float *bias, float *y) {
    const long groups = bits == 4 ? K / 32 : K / (16L << group_shift);
    const long row_bytes = bits == 4 ? groups * 16 : K;  /* codes per output row */
    const char *c = (const char *)codes;
#pragma omp for schedule(static) nowait
    for (long n = 0; n < N; n++) {
        const long ahead = n + PREFETCH_ROWS;
        prefetch_row(c + ahead * row_bytes, row_bytes, scale + ahead * groups, minv ? minv + ahead * groups : 0,
                     groups);
        if (bits == 4) {
            ROW_BLOCKS(row_q4, (const uint8_t *)c + n * row_bytes, scale + n * groups, minv + n * groups)
        } else {
            ROW_BLOCKS(row_q8, (const int8_t *)c + n * row_bytes, scale + n * groups, minv ? minv + n * groups : 0,
                       group_shift)
        }
        if (bias)
            for (long r = 0; r < T; r++) y[r * N + n] = y[r * N + n] + bias[n];
    }
}

/* All T rows of x in passes of x_rows_per_pass rows (no barrier between passes: each thread keeps its rows) */
static inline void linear_ws(int bits, long T, long N, long K, int group_shift, const float *x, const void *codes,
                             const float *scale, const float *minv, const float *bias, float *y) {
    const long step = x_rows_per_pass(T, K);
    for (long t0 = 0; t0 < T; t0 += step)
        linear_pass(bits, T - t0 < step ? T - t0 : step, N, K, group_shift, x + t0 * K, codes, scale, minv, bias,
                    y + t0 * N);
}

/* y [T, N] = x [T, K] @ W.T (+ bias) for W [N, K] in q4; K a multiple of 32.  The _ws forms share their output
 * rows among the threads of an enclosing parallel region (every thread must call them; no barrier at the end:
 * the caller places one); bias may be NULL and is added to each output row after its product. */
void selfspec_linear_q4_ws(long T, long N, long K, const float *x, const uint8_t *codes, const float *scale,
                           const float *minv, const float *bias, float *y) {
    linear_ws(4, T, N, K, 1, x, codes, scale, minv, bias, y);
}

void selfspec_linear_q4(long T, long N, long K, const float *x, const uint8_t *codes, const float *scale,
                        const float *minv, float *y) {
#pragma omp parallel
    selfspec_linear_q4_ws(T, N, K, x, codes, scale, minv, 0, y);
}

/* y [T, N] = x [T, K] @ W.T (+ bias) for W [N, K] in q8 with groups of G (16 or 32); K a multiple of 32; minv
 * may be NULL. */
void selfspec_linear_q8_ws(long T, long N, long K, long G, const float *x, const int8_t *codes,
                           const float *scale, const float *minv, const float *bias, float *y) {
    linear_ws(8, T, N, K, (int)(G == 32), x, codes, scale, minv, bias, y);
}

void selfspec_linear_q8(long T, long N, long K, long G, const float *x, const int8_t *codes,
                        const float *scale, const float *minv, float *y) {
#pragma omp parallel
    selfspec_linear_q8_ws(T, N, K, G, x, codes, scale, minv, 0, y);
}

/* out [K] = row n of W, decoded (one thread; prompt_gemm.c's panels) */
void selfspec_rows_q4_one(long n, long K, const uint8_t *codes, const float *scale, const float *minv, float *out) {
    const long groups = K / 32;
    for (long g = 0; g < groups; g++) {
        vec w0, w1;
        decode_q4(codes + n * groups * 16, scale + n * groups, minv + n * groups, g, &w0, &w1);
        v_store(out + g * 32, w0);
        v_store(out + g * 32 + LANES, w1);
    }
}

void selfspec_rows_q8_one(long n, long K, long G, const int8_t *codes, const float *scale, const float *minv,
                          float *out) {
    const long groups = K / G;
    for (long c = 0; c < K / LANES; c++)
        v_store(out + c * LANES, decode_q8(codes + n * K, scale + n * groups, minv ? minv + n * groups : 0,
                                           (int)(G == 32), c));
}

/* out [R, K] = the rows idx[0..R) of W, decoded (embedding lookups, prefill tiles, tests). */
void selfspec_rows_q4(long R, const int64_t *idx, long K, const uint8_t *codes, const float *scale,
                      const float *minv, float *out) {
#pragma omp parallel for schedule(static) if (R > 16)
    for (long r = 0; r < R; r++) selfspec_rows_q4_one(idx[r], K, codes, scale, minv, out + r * K);
}

void selfspec_rows_q8(long R, const int64_t *idx, long K, long G, const int8_t *codes, const float *scale,
                      const float *minv, float *out) {
#pragma omp parallel for schedule(static) if (R > 16)
    for (long r = 0; r < R; r++) selfspec_rows_q8_one(idx[r], K, G, codes, scale, minv, out + r * K);
}


/* The 4-bit draft copies (quant.py's low_bit_copy: symmetric codes and a half scale per 32 weights, as Q4_0), made
 * from rows of decoded weights w [n, k] (k a multiple of 32) in two passes with the scale's rounding to a half
 * between them (in torch).  The same numbers as torch's ops on the rows (abs().argmax(), then g / d + 8 rounded half
 * to even and clamped; tests/test_low_bit.py), which took 2 of the 3 s of the copies of a 0.5B Q8_0 model.
 *
 * big [n, k/32]: the weight of largest magnitude of each group (the first such; a NaN, as torch's argmax does). */
void selfspec_low_bit_big(long n, long k, const float *w, float *big) {
#pragma omp parallel for schedule(static) if (n * k > (1L << 18))
    for (long r = 0; r < n; r++) {
        for (long g = 0; g < k / 32; g++) {
            const float *p = w + r * k + g * 32;
#if defined(__AVX512F__)
            const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(p)), a1 = _mm512_abs_ps(_mm512_loadu_ps(p + 16));
            const uint32_t nan = (uint32_t)_mm512_cmp_ps_mask(a0, a0, _CMP_UNORD_Q) |
                                 (uint32_t)_mm512_cmp_ps_mask(a1, a1, _CMP_UNORD_Q) << 16;
            if (!nan) { /* the first weight of the largest magnitude (a NaN group takes the scalar loop below) */
                const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(a0, a1)));
                const uint32_t at = (uint32_t)_mm512_cmp_ps_mask(a0, m, _CMP_EQ_OQ) |
                                    (uint32_t)_mm512_cmp_ps_mask(a1, m, _CMP_EQ_OQ) << 16;
                big[r * (k / 32) + g] = p[__builtin_ctz(at)];
                continue;
            }
#endif
            long at = 0;
            float best = fabsf(p[0]);
            for (long i = 1; i < 32 && !isnan(best); i++) {
                const float a = fabsf(p[i]);
                if (isnan(a) || a > best) best = a, at = i;
            }
            big[r * (k / 32) + g] = p[at];
        }
    }
}

/* codes [n, k/2]: byte j of a group holds code j (low nibble) and code j + 16 (high), code = clamp(round(w / d + 8),
 * 0, 15) with d the group's scale (1 where it is 0), d [n, k/32] */
void selfspec_low_bit_codes(long n, long k, const float *w, const float *d, uint8_t *codes) {
#pragma omp parallel for schedule(static) if (n * k > (1L << 18))
    for (long r = 0; r < n; r++) {
        for (long g = 0; g < k / 32; g++) {
            const float *p = w + r * k + g * 32;
            const float s = d[r * (k / 32) + g] == 0.0f ? 1.0f : d[r * (k / 32) + g];
            uint8_t *out = codes + r * (k / 2) + g * 16;
#if defined(__AVX512F__)
            const __m512 sv = _mm512_set1_ps(s), eight = _mm512_set1_ps(8.0f), hi = _mm512_set1_ps(15.0f);
            __m512i c[2];
            for (int h = 0; h < 2; h++) {
                const __m512 t = _mm512_roundscale_ps(_mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(p + 16 * h), sv),
                                                                    eight), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                c[h] = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(t, _mm512_setzero_ps()), hi));
            }
            _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_or_si512(c[0], _mm512_slli_epi32(c[1], 4))));
#else
            uint8_t q[32];
            for (int i = 0; i < 32; i++) { /* roundeven: torch.round's rounding, half to even */
                float t = __builtin_roundevenf(p[i] / s + 8.0f); /* two roundings, as torch's two ops */
                t = t < 0.0f ? 0.0f : t;
                q[i] = (uint8_t)(t > 15.0f ? 15.0f : t);
            }
            for (int j = 0; j < 16; j++) out[j] = (uint8_t)(q[j] | q[j + 16] << 4);
#endif
        }
    }
}

/* A row form's codes interleaved 16 rows at a time (quant.py's pack_x16, the byte and nibble forms): the 4-byte
 * words src [nb][16 rows][groups * J] to dst [nb][groups * J][16 rows], each word XORed with `flip` (q8: 0x80 a
 * byte, code + 128).  numpy's transposed copy moved 0.5 GB/s (0.7 s of the 0.5B model's 4-bit draft copies).  One
 * thread: the model loader's threads call it several at once. */
void selfspec_x16_interleave(long nb, long words, const uint32_t *src, uint32_t *dst, uint32_t flip) {
    for (long b = 0; b < nb; b++)
        for (long w = 0; w < words; w++)
            for (int r = 0; r < 16; r++) dst[(b * words + w) * 16 + r] = src[(b * 16 + r) * words + w] ^ flip;
}
