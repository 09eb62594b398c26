/* Every x16 form of selfspec_linear_x16 (int8_kernels.c) on pseudo-random codes, scales and rows: one line per case
 * with a hash of the output's bits, after a first line naming the kernels' kind.  tests/test_int8_kernels.py builds
 * it for this machine and for other instruction sets (an aarch64 cross build run under qemu) and compares the lines:
 * every build must compute the very same numbers. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int selfspec_linear_x16(int form, long T, long N, long K, long G, const float *x, const uint8_t *codes,
                        const void *scale, const void *minv, const float *bias, float *y);
int selfspec_int8_kernels(void);
static uint64_t st = 88172645463325252ull;
static uint32_t rnd(void) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return (uint32_t)st; }
static float frnd(void) { return ((rnd() >> 8) / 16777216.0f - 0.5f) * 2.0f; }
static uint16_t half_of(float f) { _Float16 h = (_Float16)f; uint16_t u; memcpy(&u, &h, 2); return u; }
#define GB(B, G) \
    ((B) == 4 || (B) == 12 ? 256 : (B) == 2 ? 64 : (B) == 3 ? 96 : (B) == 5 ? 320 : (B) == 6 ? 192 : (G) * 16)
int main(void) {
    printf("kind %d\n", selfspec_int8_kernels());
    const int cases[][4] = {/* bits, G, sym, sk */
        {4, 32, 0, 2}, {5, 32, 0, 2}, {6, 16, 1, 2}, {4, 32, 0, 1}, {4, 32, 1, 1}, {5, 32, 0, 1}, {5, 32, 1, 1},
        {6, 16, 1, 0}, {8, 32, 0, 0}, {8, 32, 1, 1}, {8, 16, 0, 0}, {8, 16, 1, 0}, {4, 32, 0, 0}, {8, 32, 1, 0},
        {3, 16, 1, 2}, {3, 16, 1, 0}, {2, 16, 0, 2}, {2, 16, 0, 0},
        {12, 32, 1, 2}, {12, 32, 1, 1}, {12, 32, 1, 0}}; /* 12: LUT4 (IQ4's indices) */
    const long N = 48, K = 512;
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int bits = cases[c][0], G = cases[c][1], sym = cases[c][2], sk = cases[c][3];
        const long groups = K / G, nb = N / 16;
        const long sbytes = groups * 16 * (sk == 2 ? 1 : sk ? 2 : 4) + (sk == 2 ? K / 256 * 32 : 0);
        uint8_t *codes = malloc(nb * groups * GB(bits, G));
        for (long i = 0; i < nb * groups * GB(bits, G); i++) codes[i] = rnd();
        uint8_t *tabs[2];
        for (int t = 0; t < 2; t++) {
            tabs[t] = malloc(nb * sbytes);
            for (long b = 0; b < nb; b++) {
                uint8_t *p = tabs[t] + b * sbytes;
                if (sk == 0) for (long i = 0; i < groups * 16; i++) ((float *)p)[i] = frnd() * 0.01f;
                if (sk == 1) for (long i = 0; i < groups * 16; i++) ((uint16_t *)p)[i] = half_of(frnd() * 0.01f);
                if (sk == 2) {
                    for (long i = 0; i < groups * 16; i++) ((int8_t *)p)[i] = (int8_t)(rnd() % 64);
                    for (long i = 0; i < K / 256 * 16; i++) ((uint16_t *)(p + groups * 16))[i] = half_of(frnd() * 0.001f);
                }
            }
        }
        const int form = bits | (sk == 2 ? 0x200 : sk ? 0x100 : 0);
        for (long T = 1; T <= 9; T += 4) {
            float *x = malloc(T * K * 4), *y = malloc(T * N * 4), bias[48];
            for (long i = 0; i < T * K; i++) x[i] = 3 * frnd();
            for (int i = 0; i < 48; i++) bias[i] = frnd();
            selfspec_linear_x16(form, T, N, K, G, x, codes, tabs[0], sym ? NULL : tabs[1], c % 2 ? bias : NULL, y);
            uint64_t h = 1469598103934665603ull;
            for (long i = 0; i < T * N; i++) { uint32_t u; memcpy(&u, y + i, 4); h = (h ^ u) * 1099511628211ull; }
            printf("bits %d G %d sym %d sk %d T %ld hash %016llx y0 %.6g\n", bits, G, sym, sk, T, (unsigned long long)h, y[0]);
            free(x); free(y);
        }
        free(codes); free(tabs[0]); free(tabs[1]);
    }
}
