/* x @ W.T for a few rows of float32 x, W an int4 matrix packed for torch's CPU kernel.
 *
 * Decode reads every weight once per step, so a step's matrix products are bound by how
 * fast the 4-bit codes stream. torch's _weight_int4pack_mm_for_cpu is vectorized for
 * AVX512 only: on an AVX2 CPU it reads about 1.9 GB/s of codes on one core and no more on
 * two. This reads the same bytes (the packed codes and their bf16 scales and zeros, as
 * int4_weight.py holds them) at several times that, in float32 throughout (the activations
 * are not rounded to bf16 as torch's kernel needs them).
 *
 * Per group of `group` codes of a row, with s and z its scale and zero:
 *   sum_k ((c_k - 8) s + z) x_k = s * sum_k c_k x_k + (z - 8 s) * sum_k x_k
 * so the inner loop is one multiply-add per code, and each group folds in once.
 *
 * The packed layout (cpu_layout.py): block b of block_n rows starts at byte
 * b * width * block_n / 2 and holds one run of block_n / 2 bytes per column; in an
 * interleaved (full) block row j is byte j % (block_n / 2), nibble j / (block_n / 2);
 * otherwise rows 2i and 2i + 1 share byte i.
 *
 * Threads: OpenMP over blocks of rows. The library links libgomp.so.1 by soname, so in a
 * process where torch has loaded its own libgomp.so.1 it shares torch's runtime and thread
 * pool (native.py checks that only one is mapped), instead of a second pool fighting it
 * for the cores. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MAX_BLOCK_N 64
#define MAX_ROWS 8      /* rows of x a call takes (native.py splits larger calls) */
#define MAX_GROUPS 4096 /* planes * cols / group */

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Scale and (zero - 8 scale) of rows [0, n) of block b for group g. The scales are kept
 * block-major, [blocks][groups][block_n] pairs of bf16 (scale, zero): torch's kernel takes
 * them [groups][rows], which puts a block's groups 4 * rows bytes apart, a page each on a
 * large matrix, and read that way they halved this kernel's speed. */
static void group_scales(const uint16_t *scales_zeros, int64_t groups, int64_t block_n,
                         int64_t b, int64_t g, int64_t n, float *scale, float *shift) {
    const uint16_t *sz = scales_zeros + ((b * groups + g) * block_n) * 2;
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    /* a pair is one little-endian uint32: scale in its low half, zero in its high */
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (; j + 8 <= n; j += 8) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(sz + 2 * j));
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
        const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(u, high));
        _mm256_storeu_ps(scale + j, s);
        _mm256_storeu_ps(shift + j, _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z));
    }
#endif
    for (; j < n; j++) {
        scale[j] = from_bf16(sz[2 * j]);
        shift[j] = from_bf16(sz[2 * j + 1]) - 8.0f * scale[j];
    }
}

/* Any block, any layout, one row at a time: partial blocks, CPUs without AVX2. */
static void block_scalar(const uint8_t *block, const uint16_t *scales_zeros,
                         const float *x, int64_t x_stride, const float *xsum, float *out,
                         int64_t out_stride, int64_t m, int64_t cols, int64_t planes,
                         int64_t group, int64_t b, int64_t block_n, int64_t n,
                         int32_t interleaved) {
    const int64_t width = planes * cols, groups = width / group, half = n / 2;
    float scale[MAX_BLOCK_N], shift[MAX_BLOCK_N];
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) out[i * out_stride + j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        group_scales(scales_zeros, groups, block_n, b, g, n, scale, shift);
        for (int64_t j = 0; j < n; j++) {
            const int64_t byte = interleaved ? j % half : j / 2;
            const int shift_bits = interleaved ? 4 * (int)(j / half) : 4 * (int)(j % 2);
            for (int64_t i = 0; i < m; i++) {
                const float *xi = x + i * x_stride;
                float acc = 0.0f;
                for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
                    const int code = (block[kk * half + byte] >> shift_bits) & 15;
                    acc += (float)code * xi[kk % cols];
                }
                out[i * out_stride + j] += scale[j] * acc + shift[j] * xsum[i * groups + g];
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* The 32 codes of 16 bytes as floats: rows 0-15 from the low nibbles, 16-31 the high. */
static inline void unpack16(const uint8_t *run, __m256 c[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)run);
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* out[i][dst + r] += s * acc + shift * xsum for one row of x, 8 rows of W at a time. */
static inline void fold8(float *out, const float *scale, const float *shift, __m256 acc,
                         float xsum) {
    const __m256 t = _mm256_fmadd_ps(_mm256_loadu_ps(shift), _mm256_set1_ps(xsum),
                                     _mm256_loadu_ps(out));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_loadu_ps(scale), acc, t));
}

/* One group's columns of one 16-byte chunk of the runs (32 rows of W), for one row of x or
 * (two) two: the products accumulate in registers, then fold into out with the group's
 * scales. Inlined with `two` a constant, so each case is its own branch-free loop. */
static inline __attribute__((always_inline)) void chunk_group(
    const uint8_t *run, int64_t half, int64_t group, const float *x0, const float *x1,
    float *o0, float *o1, const float *scale, const float *shift, float s0, float s1,
    int64_t r_lo, int64_t r_hi, const int two) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t k = 0; k < group; k++) {
        __m256 c[4];
        unpack16(run + k * half, c);
        const __m256 v0 = _mm256_broadcast_ss(x0 + k);
        a0 = _mm256_fmadd_ps(c[0], v0, a0);
        a1 = _mm256_fmadd_ps(c[1], v0, a1);
        a2 = _mm256_fmadd_ps(c[2], v0, a2);
        a3 = _mm256_fmadd_ps(c[3], v0, a3);
        if (two) {
            const __m256 v1 = _mm256_broadcast_ss(x1 + k);
            b0 = _mm256_fmadd_ps(c[0], v1, b0);
            b1 = _mm256_fmadd_ps(c[1], v1, b1);
            b2 = _mm256_fmadd_ps(c[2], v1, b2);
            b3 = _mm256_fmadd_ps(c[3], v1, b3);
        }
    }
    fold8(o0 + r_lo, scale + r_lo, shift + r_lo, a0, s0);
    fold8(o0 + r_lo + 8, scale + r_lo + 8, shift + r_lo + 8, a1, s0);
    fold8(o0 + r_hi, scale + r_hi, shift + r_hi, a2, s0);
    fold8(o0 + r_hi + 8, scale + r_hi + 8, shift + r_hi + 8, a3, s0);
    if (two) {
        fold8(o1 + r_lo, scale + r_lo, shift + r_lo, b0, s1);
        fold8(o1 + r_lo + 8, scale + r_lo + 8, shift + r_lo + 8, b1, s1);
        fold8(o1 + r_hi, scale + r_hi, shift + r_hi, b2, s1);
        fold8(o1 + r_hi + 8, scale + r_hi + 8, shift + r_hi + 8, b3, s1);
    }
}

/* A full interleaved block (block_n 32 or 64): per group, per 16-byte chunk of the runs
 * (chunk q holds rows 16q.. in its low nibbles and half + 16q.. in its high), rows of x
 * two at a time. A group's runs are group * half bytes (1-2 KiB), so the chunks after
 * the first read them from L1. */
static void block_avx2(const uint8_t *block, const uint16_t *scales_zeros, const float *x,
                       int64_t x_stride, const float *xsum, float *out, int64_t out_stride,
                       int64_t m, int64_t cols, int64_t planes, int64_t group, int64_t b,
                       int64_t block_n) {
    const int64_t width = planes * cols, groups = width / group, half = block_n / 2;
    float scale[MAX_BLOCK_N], shift[MAX_BLOCK_N];
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < block_n; j++) out[i * out_stride + j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        group_scales(scales_zeros, groups, block_n, b, g, block_n, scale, shift);
        const int64_t k0 = g * group, xk = k0 % cols; /* every plane multiplies the same x */
        for (int64_t q = 0; q < half / 16; q++) {
            const uint8_t *run = block + k0 * half + 16 * q;
            const int64_t r_lo = 16 * q, r_hi = half + 16 * q;
            int64_t i = 0;
            for (; i + 1 < m; i += 2)
                chunk_group(run, half, group, x + i * x_stride + xk,
                            x + (i + 1) * x_stride + xk, out + i * out_stride,
                            out + (i + 1) * out_stride, scale, shift, xsum[i * groups + g],
                            xsum[(i + 1) * groups + g], r_lo, r_hi, 1);
            if (i < m)
                chunk_group(run, half, group, x + i * x_stride + xk, 0, out + i * out_stride, 0,
                            scale, shift, xsum[i * groups + g], 0.0f, r_lo, r_hi, 0);
        }
    }
}
#endif

/* out[i][n - row0] = sum_k W[n, k] x[i][k] for i < m and row0 <= n < row1 (row0 a multiple
 * of block_n; row1 a multiple of block_n or the matrix's padded rows), on `threads` threads;
 * scales_zeros block-major (group_scales). Returns 0, or
 * -1 for arguments past the fixed buffers (native.py checks them first). */
int gemv_int4(const uint8_t *packed, const uint16_t *scales_zeros, const float *x,
              int64_t x_stride, float *out, int64_t out_stride, int64_t m,
              int64_t cols, int64_t planes, int64_t group, int64_t block_n,
              int32_t interleaved, int64_t row0, int64_t row1, int32_t threads) {
    const int64_t width = planes * cols, groups = width / group;
    if (m > MAX_ROWS || block_n > MAX_BLOCK_N || groups > MAX_GROUPS || width % group) return -1;
    float sums[MAX_ROWS * MAX_GROUPS]; /* x's sum over each group: 128 KiB at most */
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xi = x + i * x_stride + (g * group) % cols;
            float s = 0.0f;
            for (int64_t k = 0; k < group; k++) s += xi[k];
            sums[i * groups + g] = s;
        }
    const int64_t num_blocks = (row1 - row0 + block_n - 1) / block_n;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t nb = 0; nb < num_blocks; nb++) {
        const int64_t first = row0 + nb * block_n;
        const int64_t n = row1 - first < block_n ? row1 - first : block_n;
        /* blocks before this one are full: each holds width * block_n / 2 bytes */
        const uint8_t *block = packed + (first / block_n) * width * (block_n / 2);
        float *o = out + (first - row0);
#if defined(__AVX2__) && defined(__FMA__)
        if (n == block_n && interleaved && block_n % 32 == 0 && cols % group == 0) {
            block_avx2(block, scales_zeros, x, x_stride, sums, o, out_stride, m, cols, planes,
                       group, first / block_n, block_n);
            continue;
        }
#endif
        block_scalar(block, scales_zeros, x, x_stride, sums, o, out_stride, m, cols, planes,
                     group, first / block_n, block_n, n, interleaved && n == block_n);
    }
    return 0;
}
