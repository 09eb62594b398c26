/* selfspec's fused decoder stack: every decoder layer of a quantised model in one C call (see fused.py).
 *
 * A decoding step of a small model on a CPU spends more time in Python and in ~40 small torch operations per
 * layer (norms, rotary, cache writes, attention plumbing, residual adds) than in its matrix products.  Here
 * one call runs all layers over T new tokens: RMS norms, the quantised products of quant_kernels.c, per-head
 * query/key norms, rotary embedding, the cache write, grouped-query attention under an optional boolean mask,
 * the gated MLP (SiLU or tanh-GELU) and the residual adds, in the layout of transformers' modules
 * (pre-norm Llama blocks; Gemma 3's sandwich norms with weight + 1).
 *
 * Row independence (why speculative decoding stays token-identical): each new token's numbers are computed
 * by the same operations in the same order whatever T is and wherever its keys sit in the cache.  Products
 * are row-exact (quant_kernels.c); norms and rotary work per row; attention walks the keys a row may see in
 * slot order, and every sum over keys is a sum over that *compacted* list, in lanes given by a key's index
 * in the list.  For a node of a verified token tree the list is the committed prefix followed by its
 * ancestors, one per depth, so its index is the token's position: the very list (and lanes) a one-token
 * step of the same sequence uses.  The file is compiled with -ffp-contract=off: vector and scalar code paths
 * perform the same IEEE operations.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void selfspec_linear_q4_ws(long T, long N, long K, const float *x, const uint8_t *codes, const float *scale,
                           const float *minv, const float *bias, float *y);
void selfspec_linear_q8_ws(long T, long N, long K, long G, const float *x, const int8_t *codes,
                           const float *scale, const float *minv, const float *bias, float *y);
int selfspec_prompt_gemm_ws(int bits, long T, long N, long K, long G, const float *x, const void *codes,
                            const float *scale, const float *minv, const float *bias, float *y);
long selfspec_qrows_bytes(long T, long K);
void selfspec_quantize_row_part(void *buf, long T, long K, long t, const float *x_t, long b0, long b1);
void selfspec_linear_x16_ws(int form, long T, long N, long K, long G, const void *buf, const uint8_t *codes,
                            const void *scale, const void *minv, const float *bias, float *y);

#define LANES 16

typedef struct {
    long bits; /* 4 (q4 form) or 8 (q8 form) */
    long N, K, G;
    const void *codes;
    const float *scale, *minv, *bias; /* minv, bias: NULL when absent */
    const uint8_t *x16_codes;         /* int8_kernels.c's interleaved copy, or NULL (fp32 products only) */
    const void *x16_scale, *x16_min;  /* fp32, IEEE halves (x16_form & 0x100) or sub-scales (0x200) */
    long x16_form; /* bits per code in the interleaved copy (4, 5, 6: compact, or 8) | 0x100 halves, 0x200 sub-scales */
} qmat;

typedef struct {
    qmat q, k, v, o, gate, up, down;
    const float *attn_in_norm, *attn_out_norm, *mlp_in_norm, *mlp_out_norm; /* out norms: NULL when absent */
    const float *q_norm, *k_norm;                                           /* per-head norms, NULL if absent */
    double eps, norm_offset; /* RMSNorm: x / rms(x) * (weight + norm_offset) */
    double scaling;          /* attention score scale */
    long n_heads, n_kv, head_dim, hidden, inter;
    long act; /* 0: SiLU, 1: tanh-approximated GELU */
} layer_t;

/* How a pass computes its products: bulk (the prompt, rows >= PROMPT_ROWS) takes prompt_gemm.c's blocked product,
 * every other pass the row kernels whose rows do not depend on T.  xq: scratch for the rows of x quantised to
 * int8 (int8_kernels.c) when the pass's products take int8 activations, else NULL.  failed: set when scratch
 * memory ran out. */
typedef struct {
    int bulk;
    void *xq;
    int *failed;
    int kv; /* how the cache holds its entries: KV_F32, KV_F16 or KV_Q8 */
    float *blocks; /* shared scratch of attention's key blocks when few rows split them between threads, or NULL */
    const long *ident; /* 0, 1, ..., the most keys a row of the pass sees: a causal row's visible slots */
    long *vis; /* [T]: how many slots each row of the pass sees in the layer at hand (attention's work shares) */
} pass_t;

#define PROMPT_ROWS 65

/* This thread's share of y = x @ W.T (+ bias), inside the stack's parallel region; no barrier.  When the pass
 * takes int8 activations, ps->xq holds x quantised (quantize()) and weights with an x16 copy use it. */
static void matmul(const qmat *m, long T, const float *x, float *y, const pass_t *ps) {
    if (ps->xq && m->x16_codes) {
        selfspec_linear_x16_ws((int)m->x16_form, T, m->N, m->K, m->G, ps->xq, m->x16_codes, m->x16_scale, m->x16_min,
                               m->bias, y);
        return;
    }
    if (ps->bulk && T >= PROMPT_ROWS) {
        if (selfspec_prompt_gemm_ws((int)m->bits, T, m->N, m->K, m->G, x, m->codes, m->scale, m->minv, m->bias, y)) {
#pragma omp atomic write
            *ps->failed = 1;
        }
        return;
    }
    if (m->bits == 4)
        selfspec_linear_q4_ws(T, m->N, m->K, x, (const uint8_t *)m->codes, m->scale, m->minv, m->bias, y);
    else
        selfspec_linear_q8_ws(T, m->N, m->K, m->G, x, (const int8_t *)m->codes, m->scale, m->minv, m->bias, y);
}

/* This thread's share [*lo, *hi) of K columns: whole blocks of 32 (the int8 rows' quantisation blocks), the last
 * thread's up to K */
static inline void column_share(long K, long *lo, long *hi) {
    const long nth = omp_get_num_threads(), me = omp_get_thread_num(), blocks = K / 32;
    *lo = blocks * me / nth * 32;
    *hi = me == nth - 1 ? K : blocks * (me + 1) / nth * 32;
}

/* Columns [lo, hi) of the rows of x [T, K] quantised into ps->xq (nothing when the pass computes in fp32).  The
 * threads share the rows' quantisation by columns, not by rows: the quantised rows are interleaved block by block
 * (int8_kernels.c, QRUN), so threads quantising rows of one run wrote into the same cache lines at every block (a
 * 5-row verification of Qwen2.5-Coder 0.5B spent 1.5 ms of its 11.6 ms pass quantising its MLP's activations,
 * 0.5 ms by columns), and each thread's columns of the activations are those its share of the products wrote. */
static void quantize_columns(long T, long K, const float *x, long lo, long hi, const pass_t *ps) {
    if (!ps->xq) return;
    for (long t = 0; t < T; t++) selfspec_quantize_row_part(ps->xq, T, K, t, x + t * K, lo / 32, hi / 32);
}

/* x [T, K] quantised into ps->xq for the products that follow, by columns (quantize_columns), then a barrier;
 * nothing when the pass computes in fp32 */
static void quantize(long T, long K, const float *x, const pass_t *ps) {
    if (!ps->xq) return;
    long lo, hi;
    column_share(K, &lo, &hi);
    quantize_columns(T, K, x, lo, hi, ps);
#pragma omp barrier
}

/* Sums over LANES partial sums (element i of a vector in lane i % LANES), the lanes then added pairwise in
 * one fixed tree (lanes l and l + w for w = 8, 4, 2, 1): the AVX-512 and the portable code compute alike. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline float lane_reduce(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

static inline float lane_sum(const float *acc) { return lane_reduce(_mm512_loadu_ps(acc)); }

static inline float dot(const float *a, const float *b, long n) {
    __m512 acc = _mm512_setzero_ps();
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_mask_add_ps(acc, m, acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + i),
                                                            _mm512_maskz_loadu_ps(m, b + i)));
    }
    return lane_reduce(acc);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The AVX2 form (CPUs without AVX-512): 16 lanes as two 8-lane halves, lanes 0-7 and 8-15, and the same IEEE
 * operations lane for lane as the 16-lane code, so that this build's numbers are the others' bit for bit */
#define FUSED_AVX2 1
#include <immintrin.h>
typedef struct {
    __m256 lo, hi;
} v16;

static inline float lane_reduce(v16 v) {
    const __m256 a = _mm256_add_ps(v.lo, v.hi);                                    /* l + l+8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l + l+4 */
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));                                        /* l + l+2 */
    b = _mm_add_ss(b, _mm_movehdup_ps(b));                                         /* l + l+1 */
    return _mm_cvtss_f32(b);
}

static inline float lane_sum(const float *acc) {
    const v16 v = {_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8)};
    return lane_reduce(v);
}

static inline float dot(const float *a, const float *b, long n) {
    v16 acc = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    long i = 0;
    for (; i + LANES <= n; i += LANES) { /* a product, then an addition: no fused multiply-add here */
        acc.lo = _mm256_add_ps(acc.lo, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        acc.hi = _mm256_add_ps(acc.hi, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    if (i == n) return lane_reduce(acc);
    float lanes[LANES]; /* a last partial block: its lanes one by one, the others left as they are */
    _mm256_storeu_ps(lanes, acc.lo);
    _mm256_storeu_ps(lanes + 8, acc.hi);
    for (int l = 0; i < n; i++, l++) lanes[l] = lanes[l] + a[i] * b[i];
    return lane_sum(lanes);
}
#else
static inline float lane_sum(const float *lanes) {
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = lanes[l];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

static inline float dot(const float *a, const float *b, long n) {
    float acc[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] = acc[l] + a[i] * b[i];
    return lane_sum(acc);
}
#endif

static void rmsnorm(const float *x, const float *w, float offset, float eps, long n, float *out) {
    const float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = (x[i] * r) * (w[i] + offset);
}

/* The model's final norm, before the head (outside the stack): rows [T, n] of x normed as the stack's own norms
 * are, into out.  One call where the model's torch module makes six operations on a decoding step's row. */
void selfspec_rms_norm_rows(long T, long n, const float *x, const float *w, float offset, float eps, float *out) {
    for (long t = 0; t < T; t++) rmsnorm(x + t * n, w, offset, eps, n, out + t * n);
}

/* e^x for x <= 0 down to about -87 (softmax weights), an elementwise formula the compiler vectorises */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504f + 12582912.0f; /* round(x / ln 2) by the 1.5 * 2^23 trick */
    const float n = t - 12582912.0f;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.98756912e-4f;
    p = p * r + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.0e-1f;
    p = (p * r) * r + r + 1.0f;
    union { float f; int32_t i; } u = {p};
    u.i += (int32_t)n * 8388608; /* n * 2^23: the exponent field */
    return u.f;
}

/* e^x for any x (activations): exp_neg of -|x|, inverted for x > 0 */
static inline float exp_any(float x) {
    const float e = exp_neg(x > 0.0f ? -x : x);
    return x > 0.0f ? 1.0f / e : e;
}

#if defined(FUSED_AVX2)
/* exp_neg and exp_any on 8 lanes by the same operations.  The AVX-512 build's compiler vectorises the scalar
 * formulas itself; this one does not (without mask registers it may not if-convert their selects), and the
 * scalar loops cost a one-token step a fifth of its time. */
static inline __m256 exp_neg8(__m256 x) {
    const __m256 lim = _mm256_set1_ps(-87.0f), magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_blendv_ps(x, lim, _mm256_cmp_ps(x, lim, _CMP_LT_OQ));
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), magic), magic);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
    __m256 p = _mm256_set1_ps(1.98756912e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.39819994e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.33345205e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.16657962e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.66666657e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvttps_epi32(n), 23); /* n * 2^23 */
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

static inline __m256 exp_any8(__m256 x) {
    const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 e = exp_neg8(_mm256_blendv_ps(x, _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)), pos));
    return _mm256_blendv_ps(e, _mm256_div_ps(_mm256_set1_ps(1.0f), e), pos);
}

/* 8 lanes of activation() */
static inline __m256 activation8(long act, __m256 x, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (act == 0) {
        const __m256 e = exp_any8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f))); /* e^-x */
        return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), u);
    }
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                   _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), x3)));
    const __m256 e = exp_any8(_mm256_mul_ps(_mm256_set1_ps(2.0f), y));
    const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, th)), u);
}
#endif

/* g = act(g) * u: SiLU (act 0) or tanh-approximated GELU (act 1) */
static void activation(long act, float *g, const float *u, long n) {
    long i = 0;
#if defined(FUSED_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(g + i, activation8(act, _mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
    if (act == 0) {
        for (; i < n; i++) g[i] = (g[i] / (1.0f + exp_any(-g[i]))) * u[i];
    } else {
        for (; i < n; i++) {
            const float x = g[i];
            const float y = 0.7978845608f * (x + 0.044715f * (x * x * x));
            const float th = 1.0f - 2.0f / (exp_any(2.0f * y) + 1.0f);
            g[i] = (0.5f * x * (1.0f + th)) * u[i];
        }
    }
}

/* p[i] = e^(p[i] - mx) for i < m: softmax's numerators */
static void softmax_exp(float *p, long m, float mx) {
    long i = 0;
#if defined(FUSED_AVX2)
    for (; i + 8 <= m; i += 8)
        _mm256_storeu_ps(p + i, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(mx))));
#endif
    for (; i < m; i++) p[i] = exp_neg(p[i] - mx);
}

/* rotate-half rotary embedding of one head vector in place; cos, sin: [hd] of this row's position */
static void rope(float *x, const float *cos, const float *sin, long hd) {
    const long half = hd / 2;
    float tmp[1024];
    for (long i = 0; i < half; i++) tmp[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (long i = half; i < hd; i++) tmp[i] = x[i] * cos[i] + x[i - half] * sin[i];
    memcpy(x, tmp, hd * sizeof(float));
}

#define RMAX 4 /* the most query heads attended together */

/* Cache entries are floats, IEEE halves (KV_F16: half the bytes that a long context's attention reads, and a
 * one-token step's attention is bound by reading them) or 8-bit blocks (KV_Q8, llama.cpp's q8_0 in spirit: each 32
 * entries of a head's row as 32 signed bytes followed by their float scale, 36 bytes, 1.125 a value; rows of
 * head_dim a multiple of 32).  An entry is rounded once, when it is written (a q8 block: scale d = max |x| / 127,
 * codes round(x / d), ties to even), and read back as the same float every time (a half widened exactly, a code
 * times its scale in one rounded product), so every pass, every build and torch's reader (cache.py) read the same
 * numbers.  Indices i count entries; a q8 block never straddles two rows. */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8 2
#define Q8_BLOCK 32
#define Q8_BYTES 36

static inline const void *kv_at(const void *base, long i, int kv) {
    if (kv == KV_Q8) return (const char *)base + i / Q8_BLOCK * Q8_BYTES + i % Q8_BLOCK;
    return (const char *)base + i * (kv == KV_F16 ? 2 : 4);
}

static inline float q8_scale(const void *base, long i) {
    float d;
    memcpy(&d, (const char *)base + i / Q8_BLOCK * Q8_BYTES + Q8_BLOCK, sizeof d);
    return d;
}

static inline float kv_get(const void *base, long i, int kv) {
    if (kv == KV_Q8) return (float)*(const int8_t *)kv_at(base, i, KV_Q8) * q8_scale(base, i);
    return kv == KV_F16 ? (float)((const _Float16 *)base)[i] : ((const float *)base)[i];
}

/* n entries (whole blocks) from entry i as q8 blocks; a block holding an infinity or NaN gets scale NaN and codes
 * 0, so that it reads back as NaN, as the model's numbers were */
static void q8_put(void *base, long i, const float *x, long n) {
    for (long b = 0; b < n; b += Q8_BLOCK) {
        char *blk = (char *)base + (i + b) / Q8_BLOCK * Q8_BYTES;
        float amax = 0.0f;
        int bad = 0;
        for (int j = 0; j < Q8_BLOCK; j++) {
            const float a = fabsf(x[b + j]);
            bad |= !(a <= FLT_MAX);
            amax = a > amax ? a : amax;
        }
        const float d = bad ? NAN : amax / 127.0f;
        int8_t *c = (int8_t *)blk;
        for (int j = 0; j < Q8_BLOCK; j++) c[j] = (int8_t)(d > 0.0f ? nearbyintf(x[b + j] / d) : 0.0f);
        memcpy(blk + Q8_BLOCK, &d, sizeof d);
    }
}

static void kv_put(void *base, long i, const float *x, long n, int kv) {
    if (kv == KV_Q8) {
        q8_put(base, i, x, n);
        return;
    }
    if (kv == KV_F32) {
        memcpy((float *)base + i, x, (size_t)n * sizeof(float));
        return;
    }
    _Float16 *d = (_Float16 *)base + i;
    long j = 0;
#if defined(__AVX512F__)
    for (; j + LANES <= n; j += LANES)
        _mm256_storeu_si256((__m256i *)(d + j),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(FUSED_AVX2)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(d + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; j < n; j++) d[j] = (_Float16)x[j]; /* round to nearest even, as the vector conversion */
}

/* out_r[d] for dimensions d0 <= d < hd, one at a time (the portable path: all of them; the vector path: those
 * past its 64-wide blocks), by the same fused multiply-adds in key order as the vector blocks */
static void weighted_dims(int R, int kv, const float *p, long pstride, const long *list, long m, const void *vc,
                          long d0, long hd, float *out) {
    if (d0 >= hd) return; /* the compiler kept the loop over the keys around an empty one: a third of the sums */
    for (int r = 0; r < R; r++) {
        const float *pr = p + r * pstride;
        float *o = out + r * hd;
        for (long d = d0; d < hd; d++) o[d] = 0.0f;
        for (long i = 0; i < m; i++)
            for (long d = d0; d < hd; d++) o[d] = fmaf(pr[i], kv_get(vc, list[i] * hd + d, kv), o[d]);
    }
}

/* Attention's two sums, for R rows (query heads sharing one key/value head and one list of visible keys,
 * contiguous in q and out, hd apart; rows of p pstride apart), each row's numbers those it gets alone:
 *   score p_r[i] = scaling * (q_r . key list[i]): per lane l < 16, the products of dimensions l, l + 16, ...
 *     chained in that order by fused multiply-adds (the first a plain product), the 16 lanes then summed as
 *     lane_sum() does;
 *   out_r[d] = sum over i of p_r[i] * value list[i] [d], by fused multiply-adds in key order from 0.
 * The rows share each key's and value's load and widening. */
/* A call of CALL(R) with R as a compile-time constant (1-4): each row count gets its own unrolled kernel */
#define ROWS_SWITCH(R, CALL) \
    switch (R) {             \
        case 4: CALL(4); break; \
        case 3: CALL(3); break; \
        case 2: CALL(2); break; \
        default: CALL(1); break; \
    }

#if defined(__AVX512F__)
static inline __m512 kv_load(const void *base, long i, int kv) {
    if (kv == KV_Q8) /* 16 codes of one block (i: a multiple of 16), each times the block's scale */
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)kv_at(base, i,
                                                                                                      KV_Q8)))),
                             _mm512_set1_ps(q8_scale(base, i)));
    return kv == KV_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)kv_at(base, i, KV_F16)))
                        : _mm512_loadu_ps((const float *)base + i);
}

/* the first n < 16 entries from i, zeros after */
static inline __m512 kv_load_part(const void *base, long i, long n, int kv) {
    if (kv == KV_F32) return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), (const float *)base + i);
    float tmp[LANES] = {0};
    for (long l = 0; l < n; l++) tmp[l] = kv_get(base, i + l, kv);
    return _mm512_loadu_ps(tmp);
}

/* The lane sums of 16 vectors at once: out lane j = lane_reduce(v[j]), by the very same additions in the same
 * order (lanes l + l+8, then l + l+4, l + l+2, l + l+1), with the 16 vectors' lanes shuffled side by side so
 * that each addition serves several of them: 15 additions instead of 64. */
static inline __m512 lane_reduce16(const __m512 v[16]) {
    __m512 u[8], w[4], x[2];
    for (int i = 0; i < 8; i++)  /* u[i]: vectors 2i, 2i+1; lanes 0-7 and 8-15: l + l+8 */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)  /* w[i]: vectors 4i..4i+3, one per quarter: l + l+4 */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)  /* quarter k of x[i]: vectors 8i+k (lanes 0-1), 8i+4+k (lanes 2-3): l + l+2 */
        x[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(w[2 * i]), _mm512_castps_pd(w[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(w[2 * i]), _mm512_castps_pd(w[2 * i + 1]))));
    /* quarter k: vectors k, 4+k, 8+k, 12+k: l + l+1 */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, s);
}

/* Keys go 16 at a time (the last block's missing ones repeat its first key, their sums dropped); each key's
 * lane vectors for the R rows are kept, and their lane sums taken 16 keys together (lane_reduce16). */
static inline __attribute__((always_inline)) void scores_rows(const int R, const int KV, const float *q,
                                                              const void *kc, long hd, const long *list, long m,
                                                              float scaling, float *p, long pstride, float *mx) {
    const long C = hd / LANES, rest = hd % LANES;
    const __mmask16 rm = (__mmask16)((1u << rest) - 1u);
    __m512 best[RMAX], lanes[RMAX][16];
    for (int r = 0; r < R; r++) best[r] = _mm512_set1_ps(-INFINITY);
    for (long i = 0; i < m; i += 16) {
        const long n = m - i < 16 ? m - i : 16;
        for (long j = 0; j < 16; j++) {
            const long base = list[i + (j < n ? j : 0)] * hd;
            __m512 t[RMAX];
            if (C > 0) {
                const __m512 k0 = kv_load(kc, base, KV);
                for (int r = 0; r < R; r++) t[r] = _mm512_mul_ps(_mm512_loadu_ps(q + r * hd), k0);
            } else {
                const __m512 k0 = kv_load_part(kc, base, rest, KV);
                for (int r = 0; r < R; r++) t[r] = _mm512_mul_ps(_mm512_maskz_loadu_ps(rm, q + r * hd), k0);
            }
            for (long c = 1; c < C; c++) {
                const __m512 kv = kv_load(kc, base + c * LANES, KV);
                for (int r = 0; r < R; r++) t[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * hd + c * LANES), kv, t[r]);
            }
            if (rest && C > 0) {
                const __m512 kv = kv_load_part(kc, base + C * LANES, rest, KV);
                for (int r = 0; r < R; r++)
                    t[r] = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(rm, q + r * hd + C * LANES), kv, t[r], rm);
            }
            for (int r = 0; r < R; r++) lanes[r][j] = t[r];
        }
        const __mmask16 nm = (__mmask16)((1u << n) - 1u);
        for (int r = 0; r < R; r++) {
            const __m512 sc = _mm512_mul_ps(lane_reduce16(lanes[r]), _mm512_set1_ps(scaling));
            _mm512_mask_storeu_ps(p + r * pstride + i, nm, sc);
            best[r] = _mm512_mask_max_ps(best[r], nm, best[r], sc);
        }
    }
    for (int r = 0; r < R; r++) mx[r] = _mm512_reduce_max_ps(best[r]);
}

/* 4 vectors (64 dimensions) of each of R rows kept in registers across all keys */
static inline __attribute__((always_inline)) void weighted_block(const int R, const int KV, const float *p,
                                                                 long pstride, const long *list, long m,
                                                                 const void *vc, long d0, long hd, float *out) {
    __m512 acc[RMAX][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (long i = 0; i < m; i++) {
        const long base = list[i] * hd + d0;
        const __m512 v0 = kv_load(vc, base, KV), v1 = kv_load(vc, base + 16, KV),
                     v2 = kv_load(vc, base + 32, KV), v3 = kv_load(vc, base + 48, KV);
        for (int r = 0; r < R; r++) {
            const __m512 w = _mm512_set1_ps(p[r * pstride + i]);
            acc[r][0] = _mm512_fmadd_ps(w, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(w, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(w, v3, acc[r][3]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + r * hd + d0 + 16 * c, acc[r][c]);
}

static void weighted_values(int R, int kv, const float *p, long pstride, const long *list, long m, const void *vc,
                            long hd, float *out) {
    long d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) {
#define WEIGHTED(N) \
    (kv == KV_Q8    ? weighted_block(N, KV_Q8, p, pstride, list, m, vc, d0, hd, out)  \
     : kv == KV_F16 ? weighted_block(N, KV_F16, p, pstride, list, m, vc, d0, hd, out) \
                    : weighted_block(N, KV_F32, p, pstride, list, m, vc, d0, hd, out))
        ROWS_SWITCH(R, WEIGHTED)
#undef WEIGHTED
    }
    weighted_dims(R, kv, p, pstride, list, m, vc, d0, hd, out);
}
#elif defined(FUSED_AVX2)
/* The AVX2 form of the two sums: 16 lanes as two halves (v16), the same operations as the AVX-512 code above */
static inline __m256 kv_load8(const void *base, long i, int kv) {
    if (kv == KV_Q8) /* 8 codes of one block (i: a multiple of 8), each times the block's scale */
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)kv_at(base, i,
                                                                                                      KV_Q8)))),
                             _mm256_set1_ps(q8_scale(base, i)));
    return kv == KV_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)kv_at(base, i, KV_F16)))
                        : _mm256_loadu_ps((const float *)base + i);
}

static inline v16 kv_load16(const void *base, long i, int kv) {
    const v16 v = {kv_load8(base, i, kv), kv_load8(base, i + 8, kv)};
    return v;
}

/* the first n < 16 entries from i, zeros after */
static inline v16 kv_load16_part(const void *base, long i, long n, int kv) {
    float tmp[LANES] = {0};
    for (long l = 0; l < n; l++) tmp[l] = kv_get(base, i + l, kv); /* as the vector loads widen */
    return kv_load16(tmp, 0, 0);
}

static inline v16 mul16(v16 a, v16 b) {
    const v16 r = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
    return r;
}

static inline v16 fmadd16(v16 a, v16 b, v16 c) {
    const v16 r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
    return r;
}

/* lanes i < n of a, lanes from n on of b */
static inline v16 first_lanes(long n, v16 a, v16 b) {
    const __m256i nv = _mm256_set1_epi32((int)n), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 mlo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, idx));
    const __m256 mhi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, _mm256_add_epi32(idx, _mm256_set1_epi32(8))));
    const v16 r = {_mm256_blendv_ps(b.lo, a.lo, mlo), _mm256_blendv_ps(b.hi, a.hi, mhi)};
    return r;
}

/* out lane j = the last three levels of lane_reduce() of a[j] (lanes l + l+4, l + l+2, l + l+1), for 8
 * vectors at once: their lanes shuffled side by side so that each addition serves several of them */
static inline __m256 lane_reduce8(const __m256 a[8]) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++) /* b[i]: lanes 0-3 of vector 2i, 4-7 of vector 2i+1: l + l+4 */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* c[i]: per half, lanes 0-1 of one vector, 2-3 of another: l + l+2 */
        c[i] = _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]))),
            _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]))));
    /* vectors 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high half: l + l+1 */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* out lane j = lane_reduce(v[j]) for 16 vectors, by the very same additions */
static inline v16 lane_reduce16(const v16 v[16]) {
    __m256 a[16];
    for (int j = 0; j < 16; j++) a[j] = _mm256_add_ps(v[j].lo, v[j].hi); /* l + l+8 */
    const v16 r = {lane_reduce8(a), lane_reduce8(a + 8)};
    return r;
}

/* q_r . key, per lane: the products of dimensions l, l + 16, ... chained by fused multiply-adds */
static inline __attribute__((always_inline)) void key_lanes(const int R, const int KV, const float *q,
                                                            const void *kc, long base, long hd, v16 *t) {
    const long C = hd / LANES, rest = hd % LANES;
    if (C > 0) {
        const v16 k0 = kv_load16(kc, base, KV);
        for (int r = 0; r < R; r++) t[r] = mul16(kv_load16(q + r * hd, 0, 0), k0);
    } else {
        const v16 k0 = kv_load16_part(kc, base, rest, KV);
        for (int r = 0; r < R; r++) t[r] = mul16(kv_load16_part(q + r * hd, 0, rest, 0), k0);
    }
    for (long c = 1; c < C; c++) {
        const v16 kv = kv_load16(kc, base + c * LANES, KV);
        for (int r = 0; r < R; r++) t[r] = fmadd16(kv_load16(q + r * hd + c * LANES, 0, 0), kv, t[r]);
    }
    if (rest && C > 0) { /* lanes past the last dimension keep their sums (not + 0 * 0: the sign of a zero) */
        const v16 kv = kv_load16_part(kc, base + C * LANES, rest, KV);
        for (int r = 0; r < R; r++)
            t[r] = first_lanes(rest, fmadd16(kv_load16_part(q + r * hd + C * LANES, 0, rest, 0), kv, t[r]), t[r]);
    }
}

/* scores_rows of the AVX-512 code: 16 keys at a time, their lane sums taken together */
static inline __attribute__((always_inline)) void scores_rows(const int R, const int KV, const float *q,
                                                              const void *kc, long hd, const long *list, long m,
                                                              float scaling, float *p, long pstride, float *mx) {
    const v16 ninf = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
    v16 best[RMAX], lanes[RMAX][16];
    for (int r = 0; r < R; r++) best[r] = ninf;
    for (long i = 0; i < m; i += 16) {
        const long n = m - i < 16 ? m - i : 16;
        for (long j = 0; j < 16; j++) {
            v16 t[RMAX];
            key_lanes(R, KV, q, kc, list[i + (j < n ? j : 0)] * hd, hd, t);
            for (int r = 0; r < R; r++) lanes[r][j] = t[r];
        }
        for (int r = 0; r < R; r++) {
            const v16 sum = lane_reduce16(lanes[r]);
            const __m256 sv = _mm256_set1_ps(scaling);
            const v16 sc = {_mm256_mul_ps(sum.lo, sv), _mm256_mul_ps(sum.hi, sv)};
            float out[LANES];
            _mm256_storeu_ps(out, sc.lo);
            _mm256_storeu_ps(out + 8, sc.hi);
            memcpy(p + r * pstride + i, out, (size_t)n * sizeof(float));
            const v16 s = first_lanes(n, sc, ninf);
            best[r].lo = _mm256_max_ps(best[r].lo, s.lo);
            best[r].hi = _mm256_max_ps(best[r].hi, s.hi);
        }
    }
    for (int r = 0; r < R; r++) {
        float b[LANES], x = -INFINITY;
        _mm256_storeu_ps(b, best[r].lo);
        _mm256_storeu_ps(b + 8, best[r].hi);
        for (int l = 0; l < LANES; l++) x = b[l] > x ? b[l] : x;
        mx[r] = x;
    }
}

/* NV vectors (8 NV dimensions) of each of R rows kept in registers across all keys: NV * R of AVX2's 16
 * registers hold sums (8 NV = 64, 32 or 16 dimensions for 1, 2, or 3-4 rows) */
static inline __attribute__((always_inline)) void weighted_block(const int R, const int KV, const int NV,
                                                                 const float *p, long pstride, const long *list,
                                                                 long m, const void *vc, long d0, long hd,
                                                                 float *out) {
    __m256 acc[RMAX][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = _mm256_setzero_ps();
    for (long i = 0; i < m; i++) {
        const long base = list[i] * hd + d0;
        __m256 w[RMAX];
        for (int r = 0; r < R; r++) w[r] = _mm256_set1_ps(p[r * pstride + i]);
        for (int c = 0; c < NV; c++) {
            const __m256 v = kv_load8(vc, base + 8 * c, KV);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(w[r], v, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) _mm256_storeu_ps(out + r * hd + d0 + 8 * c, acc[r][c]);
}

static void weighted_values(int R, int kv, const float *p, long pstride, const long *list, long m, const void *vc,
                            long hd, float *out) {
    const long width = R == 1 ? 64 : R == 2 ? 32 : 16;
    long d0 = 0;
    for (; d0 + width <= hd; d0 += width) {
#define WEIGHTED_KV(N, KV) weighted_block(N, KV, (N) == 1 ? 8 : (N) == 2 ? 4 : 2, p, pstride, list, m, vc, d0, hd, out)
#define WEIGHTED(N) \
    (kv == KV_Q8 ? WEIGHTED_KV(N, KV_Q8) : kv == KV_F16 ? WEIGHTED_KV(N, KV_F16) : WEIGHTED_KV(N, KV_F32))
        ROWS_SWITCH(R, WEIGHTED)
#undef WEIGHTED
#undef WEIGHTED_KV
    }
    weighted_dims(R, kv, p, pstride, list, m, vc, d0, hd, out);
}
#else
static void scores(int R, int kv, const float *q, const void *kc, long hd, const long *list, long m, float scaling,
                   float *p, long pstride, float *mx) {
    for (int r = 0; r < R; r++) mx[r] = -INFINITY;
    for (long i = 0; i < m; i++) {
        const long base = list[i] * hd;
        for (int r = 0; r < R; r++) {
            const float *qr = q + r * hd;
            float t[LANES];
            for (long l = 0; l < LANES; l++) t[l] = l < hd ? qr[l] * kv_get(kc, base + l, kv) : 0.0f;
            for (long d = LANES; d < hd; d++) t[d % LANES] = fmaf(qr[d], kv_get(kc, base + d, kv), t[d % LANES]);
            const float s = lane_sum(t) * scaling;
            p[r * pstride + i] = s;
            mx[r] = s > mx[r] ? s : mx[r];
        }
    }
}

static void weighted_values(int R, int kv, const float *p, long pstride, const long *list, long m, const void *vc,
                            long hd, float *out) {
    weighted_dims(R, kv, p, pstride, list, m, vc, 0, hd, out);
}
#endif

#if defined(__AVX512F__) || defined(FUSED_AVX2)
/* The vector builds' scores: scores_rows of this build, by row count and cache entry type, and for the common head
 * sizes (64: SmolLM2, Qwen2.5 0.5B; 128: Llama, Qwen2.5 1.5B+; 256: Gemma 3) with the size a constant, so that a
 * key's loop over its dimensions is unrolled (the same operations in the same order as the loop: the same
 * numbers).  The loop kept its counter and branch beside each key's 4-12 vector operations, and a long prompt's
 * attention is a quarter to a half of its prefill on the small models. */
static void scores(int R, int kv, const float *q, const void *kc, long hd, const long *list, long m, float scaling,
                   float *p, long pstride, float *mx) {
#define SCORES_HD(N, HD) \
    (kv == KV_Q8    ? scores_rows(N, KV_Q8, q, kc, HD, list, m, scaling, p, pstride, mx)  \
     : kv == KV_F16 ? scores_rows(N, KV_F16, q, kc, HD, list, m, scaling, p, pstride, mx) \
                    : scores_rows(N, KV_F32, q, kc, HD, list, m, scaling, p, pstride, mx))
#define SCORES64(N) SCORES_HD(N, 64)
#define SCORES128(N) SCORES_HD(N, 128)
#define SCORES256(N) SCORES_HD(N, 256)
#define SCORES(N) SCORES_HD(N, hd)
    if (hd == 64) {
        ROWS_SWITCH(R, SCORES64)
    } else if (hd == 128) {
        ROWS_SWITCH(R, SCORES128)
    } else if (hd == 256) {
        ROWS_SWITCH(R, SCORES256)
    } else {
        ROWS_SWITCH(R, SCORES)
    }
#undef SCORES
#undef SCORES256
#undef SCORES128
#undef SCORES64
#undef SCORES_HD
}
#endif

/* Attention runs over a row's visible keys in blocks of KEY_BLOCK (in the order of its list of visible keys): each
 * block's softmax numerators are taken against the block's own greatest score, and the blocks' sums are combined
 * in block order (combine_blocks).  The blocks do not depend on the pass (how many rows, which threads), so a
 * row's result is the same in a one-token step, a verification or a prompt; a row seeing at most KEY_BLOCK keys
 * gets exactly one softmax.  Blocks let the few rows of a decoding step share their keys between threads
 * (split_keys): a one-token step of a model with 1-3 key/value heads otherwise left a thread idle, or read the
 * keys once per query head. */
#define KEY_BLOCK 256

static inline long key_blocks(long m) { return m > KEY_BLOCK ? (m + KEY_BLOCK - 1) / KEY_BLOCK : 1; }

/* How many of a row's nkeys slots it sees, and in *slots their list: a masked row's (allow[j] set) written to list,
 * a causal row's (all nkeys) the pass's shared 0, 1, ... (ident) */
static long visible_slots(long nkeys, const uint8_t *allow, long *list, const long *ident, const long **slots) {
    *slots = allow ? list : ident;
    if (!allow) return nkeys;
    long m = 0;
    for (long j = 0; j < nkeys; j++)
        if (allow[j]) list[m++] = j;
    return m;
}

/* Keys in block b of a row's nb blocks over m visible keys (a lone block holds them all) */
static inline long block_len(long m, long nb, long b) {
    const long lo = b * KEY_BLOCK;
    return nb == 1 || m - lo < KEY_BLOCK ? m - lo : KEY_BLOCK;
}

/* One block of R query rows of one key/value head (contiguous in q, hd apart) over the keys list[0..m): each
 * row's greatest score mx[r], the sum of its softmax numerators den[r], and their weighted sum of the values in
 * out [R, hd] (not yet divided); p: scratch of R rows pstride apart */
static void attend_block(int R, int kv, const float *q, const void *kc, const void *vc, long hd, const long *list,
                         long m, float scaling, float *p, long pstride, float *out, float *mx, float *den) {
    scores(R, kv, q, kc, hd, list, m, scaling, p, pstride, mx);
    for (int r = 0; r < R; r++) {
        float *pr = p + r * pstride;
        softmax_exp(pr, m, mx[r]);
        float acc[LANES] = {0};
        long i = 0;
        for (; i + LANES <= m; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] = acc[l] + pr[i + l];
        for (int l = 0; i < m; i++, l++) acc[l] = acc[l] + pr[i];
        den[r] = lane_sum(acc);
    }
    weighted_values(R, kv, p, pstride, list, m, vc, hd, out);
}

/* One row's attention out [hd] from its nb blocks (block b: mx[b * mstride], den[b * mstride], its values' sum
 * at part + b * pstride): one block divided by its sum; several scaled by e^(mx_b - max) and summed in block
 * order, then divided. */
static void combine_blocks(long nb, const float *mx, const float *den, long mstride, const float *part,
                           long pstride, long hd, float *out) {
    if (nb == 1) {
        for (long d = 0; d < hd; d++) out[d] = part[d] / den[0];
        return;
    }
    float top = mx[0];
    for (long b = 1; b < nb; b++) top = mx[b * mstride] > top ? mx[b * mstride] : top;
    float sum = 0.0f;
    for (long d = 0; d < hd; d++) out[d] = 0.0f;
    for (long b = 0; b < nb; b++) {
        const float w = exp_neg(mx[b * mstride] - top);
        sum = sum + w * den[b * mstride];
        const float *pb = part + b * pstride;
        for (long d = 0; d < hd; d++) out[d] = out[d] + w * pb[d];
    }
    for (long d = 0; d < hd; d++) out[d] = out[d] / sum;
}

/* R query rows of one key/value head (contiguous in q and out, hd apart) attending over the same allowed cache
 * slots, block after block (a causal row's slots: ident, the others' listed in list); p: scratch of R rows pstride
 * apart; part: scratch of key_blocks(nkeys) * RMAX * (hd + 2) floats; out: [R, hd] */
static void attend_rows(int R, int kv, const float *q, const void *kc, const void *vc, long hd, long nkeys,
                        const uint8_t *allow, float scaling, long *list, const long *ident, float *p, long pstride,
                        float *part, float *out) {
    const long *slots;
    const long m = visible_slots(nkeys, allow, list, ident, &slots), nb = key_blocks(m);
    float *mx = part + nb * RMAX * hd, *den = mx + nb * RMAX;
    for (long b = 0; b < nb; b++) {
        const long lo = b * KEY_BLOCK;
        attend_block(R, kv, q, kc, vc, hd, slots + lo, block_len(m, nb, b), scaling, p + lo, pstride,
                     part + b * RMAX * hd, mx + b * RMAX, den + b * RMAX);
    }
    for (int r = 0; r < R; r++)
        combine_blocks(nb, mx + r, den + r, RMAX, part + r * hd, RMAX * hd, hd, out + r * hd);
}

/* How many query heads of one key/value head to attend together: the most (up to RMAX; a key/value head's
 * `groups` query heads go in chunks of R, the last one the heads left) that still leaves every thread two work
 * items; one where the pass is too small for that (a one-token step of a model with few key/value heads), so
 * that no thread idles.  Heads taken together read each key and value once for all of them; a row's result is
 * the same whatever R (each row's sums run in the same order).  R once had to divide `groups`: Qwen2.5's 7
 * query heads a key/value head then went one at a time, and its prompts' attention read every key 7 times. */
static int heads_together(long T, long n_kv, long groups, int threads) {
    for (int R = RMAX; R > 1; R--)
        if (T * n_kv * ((groups + R - 1) / R) >= 2 * threads) return R;
    return 1;
}

/* Attention's work items and how they are shared between the threads.  An item is R query heads of one key/value
 * head over one row's keys (attend_rows), or over one block of them where few rows share their key blocks
 * (split_keys, attend_split), ordered by key/value head, then row, then chunk of heads (then block).  Its cost
 * is its keys times (its query heads + 1: each key and value is loaded and widened once for the heads taken
 * together), and each thread takes a contiguous range of items of about equal cost, computed alike by every
 * thread from the rows' visible keys (ps->vis).  Equal numbers of items were unequal work: a prompt's causal rows
 * see 1 to T keys (with one key/value head, Gemma 3's, one thread attended 3 times as many as the other), and a
 * sliding window's rows see fewer keys than the pass's longest (Gemma 3 after 1,000 tokens: a row's 512 keys
 * in 2 blocks of 256 of the 4 items, both with one thread). */
typedef struct {
    long T, groups, R, per_t, nb; /* nb: key blocks per item row (1: whole rows, attend_rows) */
    const long *vis;
} att_items;

static inline long att_cost(const att_items *w, long it) {
    const long b = it % w->nb, c = it / w->nb % w->per_t, t = it / (w->nb * w->per_t) % w->T;
    const long heads = w->groups - c * w->R < w->R ? w->groups - c * w->R : w->R, m = w->vis[t];
    if (w->nb == 1) return m * (heads + 1);
    const long nb = key_blocks(m);
    return b < nb ? block_len(m, nb, b) * (heads + 1) : 0;
}

/* This thread's items [*lo, *hi) of the n of w: item it goes to the thread whose equal share of the total cost
 * holds the middle of the item's cost (so every thread's range is contiguous, and every thread computes the same
 * ranges) */
static void att_range(const att_items *w, long n, long *lo, long *hi) {
    const long threads = omp_get_num_threads(), me = omp_get_thread_num();
    long total = 0, before = 0;
    for (long it = 0; it < n; it++) total += att_cost(w, it);
    *lo = *hi = n;
    for (long it = 0; it < n; it++) {
        const long c = att_cost(w, it), k = total > 0 ? (2 * before + c) * threads / (2 * total) : 0;
        if (k > me) break;
        if (k == me) {
            if (*lo == n) *lo = it;
            *hi = it + 1;
        }
        before += c;
    }
}

typedef struct {
    const uint8_t *mask; /* [T, start + T] (1 = may attend) or NULL: causal (T, start: of its sequence) */
    const float *cos, *sin; /* [T, head_dim] */
    void *k, *v;            /* this layer's cache [n_kv, capacity, head_dim] (entries as pass_t.kv says) */
} layer_io;

/* The sequences of a pass.  Rows [off[s], off[s + 1]) of h belong to sequence s, whose new keys and values go
 * to slots [start[s], start[s] + T_s) of its caches of cap[s] slots; io[s * layers + i]: its layer i's mask,
 * rotary tables and caches.  One sequence: a pass of one decoding; several: the rounds of concurrent requests
 * in one batch (the weights read once for all), each row computed exactly as in a pass of its sequence alone:
 * products are row-exact and a row's attention reads only its own sequence's cache, in the same order. */
typedef struct {
    long n, layers;
    const long *off, *start, *cap;
    const long *seq_of; /* [T]: the sequence of each row */
    const layer_io *io;
} seqs_t;

/* Row t's sequence s, its index in that sequence, and the layer's io of that sequence */
typedef struct {
    long s, t;
    const layer_io *io;
} row_t;

static inline row_t row_of(const seqs_t *sq, long layer, long t) {
    const long s = sq->seq_of[t];
    return (row_t){s, t - sq->off[s], sq->io + s * sq->layers + layer};
}

/* Where the cosine similarity of each sublayer's input and output goes (ASD's statistics of the prompt):
 * row: scratch [T]; out: [sq->n * 2n], sequence s's attention of layer i at s * 2n + 2i, its MLP at
 * s * 2n + 2i + 1, each the mean over that sequence's rows.  NULL row: not collected. */
typedef struct {
    float *row, *out;
    const seqs_t *sq;
} cosines;

/* cos(a, b) of one row as torch's cosine_similarity defines it (norms' product clamped below by 1e-8) */
static float row_cosine(const float *a, const float *b, long n) {
    const float ab = dot(a, b, n), aa = dot(a, a, n), bb = dot(b, b, n);
    const float d = sqrtf(aa * bb);
    return ab / (d > 1e-8f ? d : 1e-8f);
}

/* h += o row by row, o first normed in place when the layer has an output norm (Gemma's sandwich norms);
 * a work-sharing loop with its closing barrier.  With cos->row, the mean cosine of h before and after goes to
 * *slot (one thread sums the rows in order after the loop's barrier; another barrier follows). */
static void add_residual(const float *out_norm, float off, float eps, long T, long H, float *o, float *h,
                         const cosines *cos, long slot) {
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
        float *ot = o + t * H, *ht = h + t * H;
        if (out_norm) rmsnorm(ot, out_norm, off, eps, H, ot);
        if (cos->row) {  /* o becomes the new h: cosine of old h and new h */
            for (long i = 0; i < H; i++) ot[i] = ht[i] + ot[i];
            cos->row[t] = row_cosine(ht, ot, H);
            memcpy(ht, ot, H * sizeof(float));
        } else {
            for (long i = 0; i < H; i++) ht[i] = ht[i] + ot[i];
        }
    }
    if (cos->row) {
#pragma omp single
        for (long s = 0; s < cos->sq->n; s++) {  /* each sequence's rows in order (one sequence: all T) */
            const long a = cos->sq->off[s], b = cos->sq->off[s + 1];
            double sum = 0.0;
            for (long t = a; t < b; t++) sum += cos->row[t];
            if (b > a) cos->out[s * 2 * cos->sq->layers + slot] = (float)(sum / (double)(b - a));
        }
    }
}

/* The cache slots row r may see: returns its mask row (NULL: causal) and sets *nkeys to how many slots it spans */
static inline const uint8_t *row_keys(const seqs_t *sq, row_t r, long *nkeys) {
    const long start = sq->start[r.s], all = start + sq->off[r.s + 1] - sq->off[r.s];
    *nkeys = r.io->mask ? all : start + r.t + 1;
    return r.io->mask ? r.io->mask + r.t * all : NULL;
}

/* Whether the rows of a pass share their key blocks between threads: where its rows and key/value heads alone
 * (each head's query heads together, up to RMAX) give a thread fewer than 4 work items, and some row sees more
 * than one block (keys: the most any row of the pass may see) */
static int split_keys(long T, long n_kv, long groups, long keys, int threads) {
    return keys > KEY_BLOCK && T * n_kv * ((groups + RMAX - 1) / RMAX) < 4 * threads;
}

/* Attention of a pass's few rows with their key blocks shared out between threads (split_keys): each work item
 * one block of one row's query heads of one key/value head, into ps->blocks; then each row's blocks combined,
 * as attend_rows combines them (the same numbers).  The blocks shared by their cost (att_range), then the rows'
 * combination in a work-sharing loop, each followed by a barrier. */
static void attend_split(const layer_t *L, long layer, const seqs_t *sq, long T, const float *q, float *a,
                         long *list, float *p, long pstride, const pass_t *ps) {
    const long nh = L->n_heads, nkv = L->n_kv, hd = L->head_dim, groups = nh / nkv, nbmax = key_blocks(pstride);
    const long R = groups < RMAX ? groups : RMAX, per_t = (groups + R - 1) / R;
    float *part = ps->blocks, *mx = part + T * nbmax * nh * hd, *den = mx + T * nbmax * nh;
    const att_items w = {T, groups, R, per_t, nbmax, ps->vis};
    long lo, hi;
    att_range(&w, nkv * T * per_t * nbmax, &lo, &hi);
    for (long it = lo; it < hi; it++) { /* by key/value head, then row, then chunk of heads, then block */
        const long b = it % nbmax, c = it / nbmax % per_t, t = it / (nbmax * per_t) % T;
        const long g = it / (nbmax * per_t * T), hh = g * groups + c * R;
        const int heads = (int)(groups - c * R < R ? groups - c * R : R);
        const row_t r = row_of(sq, layer, t);
        const long cap = sq->cap[r.s];
        long nkeys;
        const uint8_t *allow = row_keys(sq, r, &nkeys);
        const long *slots;
        const long m = visible_slots(nkeys, allow, list, ps->ident, &slots), nb = key_blocks(m), k0 = b * KEY_BLOCK;
        if (b >= nb) continue;
        const long at = (t * nbmax + b) * nh + hh;
        attend_block(heads, ps->kv, q + (t * nh + hh) * hd, kv_at(r.io->k, g * cap * hd, ps->kv),
                     kv_at(r.io->v, g * cap * hd, ps->kv), hd, slots + k0, block_len(m, nb, b),
                     (float)L->scaling, p + k0, pstride, part + at * hd, mx + at, den + at);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (long th = 0; th < T * nh; th++) {
        const long t = th / nh, hh = th % nh;
        long nkeys;
        const long *slots;
        const uint8_t *allow = row_keys(sq, row_of(sq, layer, t), &nkeys);
        const long m = visible_slots(nkeys, allow, list, ps->ident, &slots), at = t * nbmax * nh + hh;
        combine_blocks(key_blocks(m), mx + at, den + at, nh, part + at * hd, nh * hd, hd, a + th * hd);
    }
}

/* The blocks below run inside one parallel region (every thread calls them): products and per-row work are
 * shared out (by rows, by columns where rows are quantised, attention by cost), each share followed by the barrier
 * its readers need.  list, p: this thread's scratch for attention (start + T entries). */
static void attention_block(const layer_t *L, long layer, const seqs_t *sq, long T, float *h, float *x, float *q,
                            float *k, float *v, float *a, float *o, long *list, float *p, long pstride, float *part,
                            const cosines *cos, long slot, const pass_t *ps) {
    const long H = L->hidden, nh = L->n_heads, nkv = L->n_kv, hd = L->head_dim, groups = nh / nkv;
    const float eps = (float)L->eps, off = (float)L->norm_offset;
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) rmsnorm(h + t * H, L->attn_in_norm, off, eps, H, x + t * H);
    quantize(T, H, x, ps);
    matmul(&L->q, T, x, q, ps);
    matmul(&L->k, T, x, k, ps);
    matmul(&L->v, T, x, v, ps);
#pragma omp barrier
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
        const row_t r = row_of(sq, layer, t);
        const long start = sq->start[r.s], cap = sq->cap[r.s];
        const float *rc = r.io->cos + r.t * hd, *rs = r.io->sin + r.t * hd;
        for (long hh = 0; hh < nh; hh++) {
            float *qh = q + (t * nh + hh) * hd;
            if (L->q_norm) rmsnorm(qh, L->q_norm, off, eps, hd, qh);
            rope(qh, rc, rs, hd);
        }
        for (long g = 0; g < nkv; g++) {
            float *kh = k + (t * nkv + g) * hd;
            if (L->k_norm) rmsnorm(kh, L->k_norm, off, eps, hd, kh);
            rope(kh, rc, rs, hd);
            kv_put(r.io->k, (g * cap + start + r.t) * hd, kh, hd, ps->kv);
            kv_put(r.io->v, (g * cap + start + r.t) * hd, v + (t * nkv + g) * hd, hd, ps->kv);
        }
        long nkeys;
        const uint8_t *allow = row_keys(sq, r, &nkeys);
        long m = nkeys;
        if (allow) {
            m = 0;
            for (long j = 0; j < nkeys; j++) m += allow[j] != 0;
        }
        ps->vis[t] = m;
    }
    if (ps->blocks && split_keys(T, nkv, groups, pstride, omp_get_num_threads())) {
        attend_split(L, layer, sq, T, q, a, list, p, pstride, ps);
    } else {
        const int R = heads_together(T, nkv, groups, omp_get_num_threads());
        const long per_t = (groups + R - 1) / R; /* work items per token and key/value head */
        const att_items w = {T, groups, R, per_t, 1, ps->vis};
        long lo, hi;
        att_range(&w, nkv * T * per_t, &lo, &hi);
        for (long it = lo; it < hi; it++) { /* key/value head by key/value head: its cache stays hot */
            const long g = it / (T * per_t), t = it / per_t % T, c = it % per_t, hh = g * groups + c * R;
            const int heads = (int)(groups - c * R < R ? groups - c * R : R); /* the last chunk: the heads left */
            const row_t r = row_of(sq, layer, t);
            const long cap = sq->cap[r.s];
            long visible;
            const uint8_t *allow = row_keys(sq, r, &visible);
            attend_rows(heads, ps->kv, q + (t * nh + hh) * hd, kv_at(r.io->k, g * cap * hd, ps->kv),
                        kv_at(r.io->v, g * cap * hd, ps->kv), hd, visible, allow, (float)L->scaling, list,
                        ps->ident, p, pstride, part, a + (t * nh + hh) * hd);
        }
#pragma omp barrier
    }
    quantize(T, nh * hd, a, ps);
    matmul(&L->o, T, a, o, ps);
#pragma omp barrier
    add_residual(L->attn_out_norm, off, eps, T, H, o, h, cos, slot);
}

static void mlp_block(const layer_t *L, long T, float *h, float *x, float *gbuf, float *ubuf, float *o,
                      const cosines *cos, long slot, const pass_t *ps) {
    const long H = L->hidden, I = L->inter;
    const float eps = (float)L->eps, off = (float)L->norm_offset;
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) rmsnorm(h + t * H, L->mlp_in_norm, off, eps, H, x + t * H);
    quantize(T, H, x, ps);
    matmul(&L->gate, T, x, gbuf, ps);
    matmul(&L->up, T, x, ubuf, ps);
#pragma omp barrier
    if (ps->xq) { /* by columns: each thread's share of the gate and up products wrote its columns */
        long lo, hi;
        column_share(I, &lo, &hi);
        for (long t = 0; t < T; t++) activation(L->act, gbuf + t * I + lo, ubuf + t * I + lo, hi - lo);
        quantize_columns(T, I, gbuf, lo, hi, ps);
#pragma omp barrier
    } else {
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) activation(L->act, gbuf + t * I, ubuf + t * I, I);
    }
    matmul(&L->down, T, gbuf, o, ps);
#pragma omp barrier
    add_residual(L->mlp_out_norm, off, eps, T, H, o, h, cos, slot);
}

int selfspec_pass_threads(void); /* int8_kernels.c */

/* The stack over the sequences of sq (see seqs_t); h: [T, hidden], every sequence's rows in turn. */
static int fused_pass(const layer_t *layers, const uint8_t *skip, const seqs_t *sq, long T, float *h,
                      float *cosine_out, int bulk, int int8, int kv) {
    const long n = sq->layers;
    const int threads = selfspec_pass_threads();
    long width = 0, inter = 0, keys = 0, hd = 0, split_floats = 0;
    for (long s = 0; s < sq->n; s++) {
        const long ks = sq->start[s] + sq->off[s + 1] - sq->off[s];
        keys = ks > keys ? ks : keys;
    }
    for (long i = 0; i < n; i++) {
        const layer_t *L = layers + i;
        const long w = L->hidden > L->n_heads * L->head_dim ? L->hidden : L->n_heads * L->head_dim;
        width = w > width ? w : width;
        inter = L->inter > inter ? L->inter : inter;
        hd = L->head_dim > hd ? L->head_dim : hd;
        if (split_keys(T, L->n_kv, L->n_heads / L->n_kv, keys, threads)) {
            const long f = T * key_blocks(keys) * L->n_heads * (L->head_dim + 2);
            split_floats = f > split_floats ? f : split_floats;
        }
    }
    /* 64-byte aligned rows (hidden sizes are multiples of 16 floats): a vector load that straddles two cache
     * lines costs two, and a prompt pass ran at 0.6 of its speed whenever malloc handed out a misaligned block */
    width = (width + 15) / 16 * 16;
    inter = (inter + 15) / 16 * 16;
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 64, sizeof(float) * (T * (6 * width + 2 * inter) + (cosine_out ? T : 0))))
        return -1;
    const cosines cos = {cosine_out ? buf + T * (6 * width + 2 * inter) : NULL, cosine_out, sq};
    float *x = buf, *q = x + T * width, *k = q + T * width, *v = k + T * width, *a = v + T * width;
    float *o = a + T * width, *g = o + T * width, *u = g + T * inter;
    void *xq = NULL;
    if (int8 && !(bulk && T >= PROMPT_ROWS) &&
        posix_memalign(&xq, 64, (size_t)selfspec_qrows_bytes(T, width > inter ? width : inter))) {
        free(buf);
        return -1;
    }
    float *blocks = split_floats ? malloc(split_floats * sizeof(float)) : NULL;
    long *ident = malloc((keys > 0 ? keys : 1) * sizeof(long)), *vis = malloc((T > 0 ? T : 1) * sizeof(long));
    int failed = (split_floats && !blocks) || !ident || !vis;
    if (ident)
        for (long j = 0; j < keys; j++) ident[j] = j;
    const pass_t ps = {bulk, xq, &failed, kv, blocks, ident, vis};
#pragma omp parallel num_threads(threads)
    {
        long *list = malloc(keys * sizeof(long));
        float *p = malloc(RMAX * keys * sizeof(float));
        float *part = malloc(key_blocks(keys) * RMAX * (hd + 2) * sizeof(float));
        if (!list || !p || !part) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        for (long i = 0; i < n && !failed; i++) {  /* every thread reads the same `failed` after the barrier */
            const layer_t *L = layers + i;
            if (!skip[2 * i])
                attention_block(L, i, sq, T, h, x, q, k, v, a, o, list, p, keys, part, &cos, 2 * i, &ps);
            if (!skip[2 * i + 1]) mlp_block(L, T, h, x, g, u, o, &cos, 2 * i + 1, &ps);
        }
        free(list);
        free(p);
        free(part);
    }
    free(blocks);
    free(ident);
    free(vis);
    free(buf);
    free(xq);
    return failed ? -1 : 0;
}

/* Runs layers 0..n-1 over h [T, hidden] in place.  skip: [2n] flags (attention of layer i at 2i, MLP at
 * 2i+1); io: [n] per-layer mask, rotary table and cache buffers; new keys/values go to slots
 * [start, start + T) of caches with `cap` slots.  cosine_out: NULL, or [2n] that receives each computed
 * sublayer's mean cosine of input and output (skipped ones are left as they are).  bulk: the prompt's pass,
 * whose products of PROMPT_ROWS rows or more take prompt_gemm.c (0: every product in the T-independent row
 * kernels).  int8: products of weights with an x16 copy take int8 activations (int8_kernels.c), except in a
 * bulk pass's prompt kernel.  kv: how the caches hold their entries (KV_F32, KV_F16, KV_Q8).  Returns 0, or -1
 * when scratch memory is unavailable. */
int selfspec_fused_layers(long n, const layer_t *layers, const uint8_t *skip, const layer_io *io, long T,
                          long start, long cap, float *h, float *cosine_out, int bulk, int int8, int kv) {
    long *seq_of = calloc((size_t)(T > 0 ? T : 1), sizeof(long));
    if (!seq_of) return -1;
    const long off[2] = {0, T};
    const seqs_t sq = {1, n, off, &start, &cap, seq_of, io};
    const int status = fused_pass(layers, skip, &sq, T, h, cosine_out, bulk, int8, kv);
    free(seq_of);
    return status;
}

/* Several sequences' rounds in one pass (concurrent requests, see seqs_t): nseq sequences, rows [off[s],
 * off[s + 1]) of h [off[nseq], hidden] being sequence s's new tokens at slots from start[s] of its caches of
 * cap[s] slots; io: [nseq * n] (sequence by sequence, each its n layers); skip as above, for every sequence;
 * cosine_out: NULL, or [nseq * 2n] that receives each sequence's mean cosines as selfspec_fused_layers gives them.
 * Never the prompt kernel: each row is computed as a one-sequence pass of the row kernels computes it.  Returns 0, or -1 when scratch memory is unavailable. */
int selfspec_fused_layers_batch(long n, const layer_t *layers, const uint8_t *skip, const layer_io *io,
                                long nseq, const long *off, const long *start, const long *cap, float *h,
                                float *cosine_out, int int8, int kv) {
    const long T = off[nseq];
    long *seq_of = malloc((size_t)(T > 0 ? T : 1) * sizeof(long));
    if (!seq_of) return -1;
    for (long s = 0; s < nseq; s++)
        for (long t = off[s]; t < off[s + 1]; t++) seq_of[t] = s;
    const seqs_t sq = {nseq, n, off, start, cap, seq_of, io};
    const int status = fused_pass(layers, skip, &sq, T, h, cosine_out, 0, int8, kv);
    free(seq_of);
    return status;
}

/* Copies cache slots src[i] to slots dst + i (i < n) in each of nbuf buffers of [heads[b], cap, dims[b]] entries of
 * esize bytes (floats, halves, or the bytes of q8 blocks):
 * the accepted path of a verified token tree made contiguous.  src increases and src[i] >= dst + i, so copying
 * in order never overwrites a slot still to be read. */
void selfspec_move_slots(long nbuf, const uint64_t *bufs, const long *heads, const long *dims, long cap,
                         const long *src, long n, long dst, long esize) {
    for (long b = 0; b < nbuf; b++) {
        char *buf = (char *)(uintptr_t)bufs[b];
        const long d = dims[b] * esize;
        for (long h = 0; h < heads[b]; h++)
            for (long i = 0; i < n; i++)
                if (src[i] != dst + i)
                    memmove(buf + (h * cap + dst + i) * d, buf + (h * cap + src[i]) * d, (size_t)d);
    }
}
