/* The prompt's products in float32, as a blocked matrix product (see quant.py: prefill_kernel "gemm").
 *
 * y [T, N] = x [T, K] @ W.T (+ bias) for W in the q4 / q8 forms of quant_kernels.c.  Each thread decodes 32 output
 * rows of W at a time into a panel [K][32] (k-major, never stored beyond the call), then multiplies it with MR rows
 * of x at a time: each x value, broadcast once, feeds two FMAs (32 outputs) into 2 * MR accumulators held in
 * registers.  A one-token product instead reads each decoded weight once per row of x from the weight's own row
 * (dot-product order, quant_kernels.c); this one sums over k in order per output, so its rows are not bit-equal to
 * one-token rows: only the prompt, which every method prefills alike, uses it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void selfspec_rows_q4_one(long n, long K, const uint8_t *codes, const float *scale, const float *minv, float *out);
void selfspec_rows_q8_one(long n, long K, long G, const int8_t *codes, const float *scale, const float *minv,
                          float *out);

#define PANEL 32
#define MR 8

#if defined(__AVX512F__)
#include <immintrin.h>

int selfspec_prompt_gemm_available(void) { return 1; }

/* y [mr, 32] (row stride ldy; only the first `cols` columns stored) = x [mr, K] (row stride ldx) @ panel [K][32] */
static inline __attribute__((always_inline)) void block(int mr, long K, const float *x, long ldx, const float *panel,
                                                        float *y, long ldy, __mmask16 m0, __mmask16 m1) {
    __m512 c0[MR], c1[MR];
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    for (long k = 0; k < K; k++) {
        const __m512 b0 = _mm512_load_ps(panel + k * PANEL), b1 = _mm512_load_ps(panel + k * PANEL + 16);
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
            c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
            c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, m0, c0[i]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, m1, c1[i]);
    }
}

/* decode output rows n0 .. n0 + cols - 1 into panel [K][32] (missing columns zero); row: scratch [K] */
static void fill_panel(int bits, long K, long G, const void *codes, const float *scale, const float *minv, long n0,
                       long cols, float *row, float *panel) {
    for (long j = 0; j < PANEL; j++) {
        if (j < cols) {
            if (bits == 4)
                selfspec_rows_q4_one(n0 + j, K, codes, scale, minv, row);
            else
                selfspec_rows_q8_one(n0 + j, K, G, codes, scale, minv, row);
        } else {
            memset(row, 0, K * sizeof(float));
        }
        for (long k = 0; k < K; k++) panel[k * PANEL + j] = row[k];
    }
}

/* This thread's share (panels of 32 output rows) of the product; every thread of the enclosing parallel region
 * calls it; no barrier at the end.  bits: 4 (q4) or 8 (q8 in groups of G).  Returns -1 if scratch memory failed
 * (then this thread's panels are left unwritten), 0 otherwise. */
int selfspec_prompt_gemm_ws(int bits, long T, long N, long K, long G, const float *x, const void *codes,
                            const float *scale, const float *minv, const float *bias, float *y) {
    float *panel = NULL;
    if (posix_memalign((void **)&panel, 64, sizeof(float) * (K * PANEL + K))) panel = NULL;
    float *row = panel ? panel + K * PANEL : NULL;
    int failed = panel == NULL;
#pragma omp for schedule(static) nowait
    for (long n0 = 0; n0 < N; n0 += PANEL) {
        if (failed) continue;
        const long cols = N - n0 < PANEL ? N - n0 : PANEL;
        const __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1u);
        const __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xFFFF : cols > 16 ? (1u << (cols - 16)) - 1u : 0u);
        fill_panel(bits, K, G, codes, scale, minv, n0, cols, row, panel);
        long t = 0;
        for (; t + MR <= T; t += MR) block(MR, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1);
        switch (T - t) {
            case 7: block(7, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1); break;
            case 6: block(6, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1); break;
            case 5: block(5, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1); break;
            case 4: block(4, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1); break;
            case 3: block(3, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1); break;
            case 2: block(2, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1); break;
            case 1: block(1, K, x + t * K, K, panel, y + t * N + n0, N, m0, m1); break;
            default: break;
        }
        if (bias)
            for (long r = 0; r < T; r++)
                for (long j = 0; j < cols; j++) y[r * N + n0 + j] = y[r * N + n0 + j] + bias[n0 + j];
    }
    free(panel);
    return failed ? -1 : 0;
}

#else
int selfspec_prompt_gemm_available(void) { return 0; }

int selfspec_prompt_gemm_ws(int bits, long T, long N, long K, long G, const float *x, const void *codes,
                            const float *scale, const float *minv, const float *bias, float *y) {
    (void)bits, (void)T, (void)N, (void)K, (void)G, (void)x, (void)codes, (void)scale, (void)minv, (void)bias, (void)y;
    return -1;
}
#endif

/* The whole product in its own parallel region (quant.py's module path); 0 on success, -1 without memory. */
int selfspec_prompt_gemm(int bits, long T, long N, long K, long G, const float *x, const void *codes,
                         const float *scale, const float *minv, const float *bias, float *y) {
    int failed = 0;
#pragma omp parallel
    {
        if (selfspec_prompt_gemm_ws(bits, T, N, K, G, x, codes, scale, minv, bias, y) != 0) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}
