/* The prompt's many-row products on quantised weights at float32 accuracy, with bfloat16 dot products.
 *
 * quant.py calls these for prefill (T >= PREFILL_ROWS rows inside bulk_rows()) where the CPU has AVX512-BF16.
 * The trick that keeps float32 accuracy: every weight is scale[group] * q + min[group] with a small integer
 * code q (|q| <= 128), exact in bfloat16; every activation x (fp32, 24 significant bits) is split exactly into
 * three bfloat16 pieces x = hi + mid + lo (8 bits each; hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid).
 * A bfloat16 product of a piece and a code is exact in fp32, so
 *     y[t, n] = sum_g scale[n, g] * (sum_{k in g} (hi + mid + lo)[t, k] * q[n, k]) + min[n, g] * xsum[t, g]
 * carries only fp32 accumulation rounding, like an fp32 GEMM on the decoded weights (measured: max error
 * relative to the largest output 2e-7, torch's fp32 GEMM 4e-7), at 1.4x its speed here, since a vdpbf16ps does
 * four times the multiply-adds of an fp32 FMA and the three pieces take three.
 *
 * Layout: x is split once per call into x3 [T][K/2][3][2] (for each pair of k: the hi, mid and lo pairs) and
 * xsum [T][K/G]; each thread decodes one block of 32 output rows at a time into bf16 code pairs [K/2][32][2]
 * (L1/L2 resident) and runs all T rows over it in tiles of ROWS rows x 32 outputs.
 * Decoding steps and verification never come here (their products must be row-for-row equal whatever the
 * number of rows: quant_kernels.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int selfspec_prefill_available(void) { return 1; }

#define ROWS 4

/* acc += pairs(w) . pair broadcast from p (embedded broadcast: GCC 12's intrinsic spills the weights) */
#define DOT_PAIR(acc, w, p) __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int *)(p)))

static inline __m256i bf16_bits(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline __m512 bf16_value(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

/* x [T, K] fp32 -> x3 [T][K/2][3][2] bf16 pieces, and xsum [T][K/G] (when xsum is not NULL). */
void selfspec_prefill_split(long T, long K, long G, const float *x, uint16_t *x3, float *xsum) {
#pragma omp parallel for schedule(static)
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * K;
        uint32_t *out = (uint32_t *)(x3 + t * K * 3);
        for (long k = 0; k < K; k += 16) {
            const __m512 v = _mm512_loadu_ps(xr + k);
            const __m256i hi = bf16_bits(v);
            const __m512 r1 = _mm512_sub_ps(v, bf16_value(hi));
            const __m256i mid = bf16_bits(r1);
            const __m256i lo = bf16_bits(_mm512_sub_ps(r1, bf16_value(mid)));
            uint32_t h[8], m[8], l[8];
            _mm256_storeu_si256((__m256i *)h, hi);
            _mm256_storeu_si256((__m256i *)m, mid);
            _mm256_storeu_si256((__m256i *)l, lo);
            for (int j = 0; j < 8; j++) {
                uint32_t *o = out + (k / 2 + j) * 3;
                o[0] = h[j];
                o[1] = m[j];
                o[2] = l[j];
            }
        }
        if (xsum)
            for (long g = 0; g < K / G; g++) {
                float s = 0.0f;
                for (long k = g * G; k < (g + 1) * G; k++) s += xr[k];
                xsum[t * (K / G) + g] = s;
            }
    }
}

/* Codes of output rows n0..n0+31 -> bf16 pairs [K/2][32][2]; scales and minimums -> [K/G][32]. q4 holds 4-bit
 * codes (groups of 32, byte j of a group: element j low nibble, j + 16 high nibble); q8 one signed byte each. */
static void pack_block(int q4, long n0, long K, long G, const void *codes, const float *scale, const float *minv,
                       uint32_t *wpairs, float *sblk, float *mblk) {
    const long groups = K / G;
    for (int j = 0; j < 32; j++) {
        const long n = n0 + j;
        for (long k = 0; k < K; k += 32) {
            __m512 a, b;  /* elements k..k+15, k+16..k+31 */
            if (q4) {
                const __m128i c = _mm_loadu_si128((const __m128i *)((const uint8_t *)codes + n * (K / 2) + k / 2));
                const __m128i mask = _mm_set1_epi8(15);
                a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(c, mask)));
                b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), mask)));
            } else {
                const int8_t *c = (const int8_t *)codes + n * K + k;
                a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
                b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
            }
            uint32_t pa[8], pb[8];
            _mm256_storeu_si256((__m256i *)pa, bf16_bits(a));
            _mm256_storeu_si256((__m256i *)pb, bf16_bits(b));
            for (int p = 0; p < 8; p++) {
                wpairs[(k / 2 + p) * 32 + j] = pa[p];
                wpairs[(k / 2 + 8 + p) * 32 + j] = pb[p];
            }
        }
        for (long g = 0; g < groups; g++) {
            sblk[g * 32 + j] = scale[n * groups + g];
            if (mblk) mblk[g * 32 + j] = minv[n * groups + g];
        }
    }
}

/* ROWS rows x 32 outputs over all K; G (16 or 32) a constant after inlining. */
static inline __attribute__((always_inline)) void tile(long G, long K, const uint16_t *const *xr,
                                                       const float *const *xs, const uint32_t *wpairs,
                                                       const float *sblk, const float *mblk, float *const *yr) {
    __m512 tot[ROWS][2];
    for (int r = 0; r < ROWS; r++) tot[r][0] = tot[r][1] = _mm512_setzero_ps();
    for (long g = 0; g < K / G; g++) {
        __m512 a0[ROWS][2], a1[ROWS][2];  /* the hi piece; the mid and lo pieces */
        for (int r = 0; r < ROWS; r++) a0[r][0] = a0[r][1] = a1[r][0] = a1[r][1] = _mm512_setzero_ps();
        for (long kp = g * G / 2; kp < (g + 1) * G / 2; kp++) {
            const __m512i w0 = _mm512_loadu_si512(wpairs + kp * 32), w1 = _mm512_loadu_si512(wpairs + kp * 32 + 16);
            for (int r = 0; r < ROWS; r++) {
                const uint16_t *p = xr[r] + kp * 6;
                DOT_PAIR(a0[r][0], w0, p);
                DOT_PAIR(a0[r][1], w1, p);
                DOT_PAIR(a1[r][0], w0, p + 2);
                DOT_PAIR(a1[r][1], w1, p + 2);
                DOT_PAIR(a1[r][0], w0, p + 4);
                DOT_PAIR(a1[r][1], w1, p + 4);
            }
        }
        const __m512 s0 = _mm512_loadu_ps(sblk + g * 32), s1 = _mm512_loadu_ps(sblk + g * 32 + 16);
        for (int r = 0; r < ROWS; r++) {
            tot[r][0] = _mm512_fmadd_ps(_mm512_add_ps(a0[r][0], a1[r][0]), s0, tot[r][0]);
            tot[r][1] = _mm512_fmadd_ps(_mm512_add_ps(a0[r][1], a1[r][1]), s1, tot[r][1]);
        }
        if (mblk) {
            const __m512 m0 = _mm512_loadu_ps(mblk + g * 32), m1 = _mm512_loadu_ps(mblk + g * 32 + 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512 sx = _mm512_set1_ps(xs[r][g]);
                tot[r][0] = _mm512_fmadd_ps(m0, sx, tot[r][0]);
                tot[r][1] = _mm512_fmadd_ps(m1, sx, tot[r][1]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        _mm512_storeu_ps(yr[r], tot[r][0]);
        _mm512_storeu_ps(yr[r] + 16, tot[r][1]);
    }
}

/* y [T, N] = x @ W.T from the split x (selfspec_prefill_split with the same G); N a multiple of 32, K of 32.
 * q4 != 0: codes in the q4 form (G = 32); else q8 with groups of G (16 or 32).  minv may be NULL (then xsum may
 * be too).  Returns 0, or -1 when a block buffer could not be allocated (y is then incomplete). */
int selfspec_prefill_gemm(long T, long N, long K, long G, int q4, const uint16_t *x3, const float *xsum,
                          const void *codes, const float *scale, const float *minv, float *y) {
    int failed = 0;
#pragma omp parallel
    {
        uint32_t *wpairs = aligned_alloc(64, (size_t)K * 16 * sizeof(uint32_t));  /* K/2 pairs x 32 outputs */
        float *sblk = aligned_alloc(64, (size_t)(K / G) * 32 * sizeof(float) * 2);
        float *mblk = minv && sblk ? sblk + (K / G) * 32 : NULL;
        float pad[32];
#pragma omp for schedule(static)
        for (long b = 0; b < N / 32; b++) {
            if (!wpairs || !sblk) {  /* every thread must still reach the loop's closing barrier */
#pragma omp atomic write
                failed = 1;
                continue;
            }
            pack_block(q4, b * 32, K, G, codes, scale, minv, wpairs, sblk, mblk);
            for (long t0 = 0; t0 < T; t0 += ROWS) {
                const uint16_t *xr[ROWS];
                const float *xs[ROWS];
                float *yr[ROWS];
                for (int r = 0; r < ROWS; r++) {
                    const long t = t0 + r < T ? t0 + r : T - 1;  /* a short last tile repeats its last row */
                    xr[r] = x3 + t * K * 3;
                    xs[r] = xsum ? xsum + t * (K / G) : NULL;
                    yr[r] = t0 + r < T ? y + t * N + b * 32 : pad;
                }
                if (G == 16)
                    tile(16, K, xr, xs, wpairs, sblk, mblk, yr);
                else
                    tile(32, K, xr, xs, wpairs, sblk, mblk, yr);
            }
        }
        free(wpairs);
        free(sblk);
    }
    return failed ? -1 : 0;
}

#else
int selfspec_prefill_available(void) { return 0; }  /* no AVX512-BF16: quant.py multiplies decoded fp32 tiles */
#endif
