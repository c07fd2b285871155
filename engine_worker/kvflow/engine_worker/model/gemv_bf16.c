/* x @ W.T (+ bias, + residual) for a few rows of bf16 x, W a dense bf16 matrix.
 *
 * A bf16 model's decode step reads every weight once, so its products are bound by how fast
 * W streams. torch's CPU bf16 linear at one or a few rows reads W at about half the
 * machine's streamed bandwidth (docs/benchmarks.md, "Decode against the CPU's limits").
 * Here each row of W is read once for all rows of x, 32 columns an instruction with
 * AVX512-BF16's `vdpbf16ps`: it multiplies pairs of bf16 exactly and adds them into float32
 * lanes, so a product costs no widening. Sums are float32, as torch's are; the result is
 * rounded to bf16 once, after the bias and the residual are added (torch's addmm rounds
 * once too), to nearest even.
 *
 * Register blocking: tiles of 4 rows of W against up to ROWS_X rows of x, 4 * ROWS_X
 * accumulators of 16 lanes; each 64-byte load of W feeds every row of x. Past 4 rows of x
 * torch's bf16 GEMM (AMX or AVX512 through oneDNN) is faster than passes of this.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU);
 * elsewhere `gemv_bf16_available` returns 0 and dense_gemv.py keeps torch's linear.
 *
 * Threads: OpenMP over blocks of W's rows, sharing torch's libgomp (native_build.py's
 * one_openmp_runtime). */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16 1
#endif

/* While a tile's rows stream, the rows PF_ROWS ahead are prefetched, at the same columns:
 * the hardware prefetcher, following four streams that each end after a KiB or two (a row),
 * keeps torch's loop at about half the streamed bandwidth on small matrices; with the
 * prefetches a model of SmolLM2's shapes reads 1.3x as fast (4 and 8 rows ahead measured
 * alike, 16 and 32 slower). A prefetch past W's end is harmless: prefetches never fault.
 * -DPF_ROWS=0 builds without them (the benchmark's arm). */
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
#define ROWS_X 4 /* rows of x one pass takes; the caller's call splits larger batches */

int gemv_bf16_available(void) {
#ifdef HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

int gemv_bf16_max_rows(void) { return ROWS_X; }

#ifdef HAVE_BF16
static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline __m512bh load_bh(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* out[m][r] for r in [r0, r0 + NW), m < nx, each an accumulator of 16 float lanes. */
#define DEFINE_TILE(NW)                                                                    \
    static void tile_##NW(const uint16_t *w, int64_t w_stride, const uint16_t *x,          \
                          int64_t x_stride, int64_t nx, int64_t cols, float sums[][NW]) {  \
        __m512 acc[ROWS_X][NW];                                                            \
        for (int m = 0; m < ROWS_X; m++)                                                   \
            for (int j = 0; j < NW; j++) acc[m][j] = _mm512_setzero_ps();                  \
        for (int64_t k = 0; k < cols; k += 32) {                                           \
            const __mmask32 mask = cols - k >= 32 ? 0xFFFFFFFFu : (1u << (cols - k)) - 1u; \
            __m512bh wv[NW];                                                               \
            for (int j = 0; j < NW; j++) {                                                 \
                if (PF_ROWS)                                                               \
                    _mm_prefetch((const char *)(w + (j + PF_ROWS) * w_stride + k),         \
                                 _MM_HINT_T0);                                             \
                wv[j] = load_bh(w + j * w_stride + k, mask);                               \
            }                                                                              \
            for (int m = 0; m < nx; m++) {                                                 \
                const __m512bh xv = load_bh(x + m * x_stride + k, mask);                   \
                for (int j = 0; j < NW; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv); \
            }                                                                              \
        }                                                                                  \
        for (int m = 0; m < nx; m++)                                                       \
            for (int j = 0; j < NW; j++) sums[m][j] = _mm512_reduce_add_ps(acc[m][j]);     \
    }
DEFINE_TILE(4)
DEFINE_TILE(1)
#endif

/* out[m, r] = bf16(sum_k x[m, k] W[r, k] + bias[r] + residual[m, r]) for m < nx (at most
 * ROWS_X), r < rows. bias and residual may be NULL. Strides in elements. Returns 0, or -1
 * where this build has no AVX512-BF16. */
int gemv_bf16(const uint16_t *w, int64_t w_stride, int64_t rows, int64_t cols,
              const uint16_t *x, int64_t x_stride, int64_t nx, const uint16_t *bias,
              const uint16_t *residual, int64_t residual_stride, uint16_t *out,
              int64_t out_stride, int32_t threads) {
#ifdef HAVE_BF16
    if (nx < 1 || nx > ROWS_X) return -1;
    const int64_t tiles = rows / 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t <= tiles; t++) {
        const int64_t r0 = 4 * t;
        const int64_t nw = t < tiles ? 4 : rows - r0;
        float sums[ROWS_X][4];
        if (nw == 4) {
            tile_4(w + r0 * w_stride, w_stride, x, x_stride, nx, cols, sums);
        } else {
            for (int64_t j = 0; j < nw; j++) {
                float one[ROWS_X][1];
                tile_1(w + (r0 + j) * w_stride, w_stride, x, x_stride, nx, cols, one);
                for (int64_t m = 0; m < nx; m++) sums[m][j] = one[m][0];
            }
        }
        for (int64_t m = 0; m < nx; m++)
            for (int64_t j = 0; j < nw; j++) {
                float v = sums[m][j];
                if (bias) v += from_bf16(bias[r0 + j]);
                if (residual) v += from_bf16(residual[m * residual_stride + r0 + j]);
                out[m * out_stride + r0 + j] = to_bf16(v);
            }
    }
    return 0;
#else
    (void)w, (void)w_stride, (void)rows, (void)cols, (void)x, (void)x_stride, (void)nx;
    (void)bias, (void)residual, (void)residual_stride, (void)out, (void)out_stride;
    (void)threads;
    return -1;
#endif
}
