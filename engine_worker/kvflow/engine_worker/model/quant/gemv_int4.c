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
 * Rows of x (a decode batch) share each conversion of codes to floats: six rows at a time
 * (chunk16_rows), then four, two, one. Past a row or two the conversion, not the
 * multiply-adds, is what the float32 path spends its time on.
 *
 * The packed layout (cpu_layout.py): block b of block_n rows starts at byte
 * b * width * block_n / 2 and holds one run of block_n / 2 bytes per column; in an
 * interleaved (full) block row j is byte j % (block_n / 2), nibble j / (block_n / 2);
 * otherwise rows 2i and 2i + 1 share byte i.
 *
 * int8 activations (``int8_x``): decode's products are bound by converting codes to float
 * (about 17 G codes a second on a Zen 2 core at one row), not by memory. With each row of x
 * rounded to int8 in blocks of QK columns, one float scale each (amax / 127, as llama.cpp's
 * Q8_0), a `vpmaddubsw` multiplies 32 unsigned codes by 32 signed activations and adds
 * pairs, exactly, in one instruction, where float32 takes ten to convert 32 codes and 4
 * FMAs. Only the activations are rounded; the result is W times the rounded x, xq_k = d_b q_k:
 *   out = sum_g s * sum_b d_b sum_k (c_k - 8) q_k + z * sum_k xq_k,
 * with sum (c - 8) q = sum c q - 8 sum q in integers, exactly. Its error is then
 * sum_k W_k (xq_k - x_k), each weight times its activation's rounding. (The zero's term on
 * the exact sum of x would leave s (c - 8) times the rounding instead: more than W where
 * planes cancel, as Q6_K's do, 3.5x a bf16 model's error on a small one.) Blocks the int8
 * loop does not take (partial ones) run the float32 loop on xq and its sums: the same
 * product.
 *
 * Threads: OpenMP over blocks of rows. The library links libgomp.so.1 by soname, so in a
 * process where torch has loaded its own libgomp.so.1 it shares torch's runtime and thread
 * pool (native.py checks that only one is mapped), instead of a second pool fighting it
 * for the cores. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MAX_BLOCK_N 64
#define MAX_ROWS 12     /* rows of x a call takes (native.py splits larger calls) */
#define MAX_GROUPS 4096 /* planes * cols / group */
#define QK 32           /* columns of x per int8 scale */

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Scale and (zero - centre * scale) of rows [0, n) of block b for group g (centre 8, the
 * codes' offset, or 0 for the zero alone). The scales are kept
 * block-major, [blocks][groups][block_n] pairs of bf16 (scale, zero): torch's kernel takes
 * them [groups][rows], which puts a block's groups 4 * rows bytes apart, a page each on a
 * large matrix, and read that way they halved this kernel's speed. */
static void group_scales(const uint16_t *scales_zeros, int64_t groups, int64_t block_n,
                         int64_t b, int64_t g, int64_t n, float centre, float *scale,
                         float *shift) {
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
        _mm256_storeu_ps(shift + j, _mm256_fnmadd_ps(_mm256_set1_ps(centre), s, z));
    }
#endif
    for (; j < n; j++) {
        scale[j] = from_bf16(sz[2 * j]);
        shift[j] = from_bf16(sz[2 * j + 1]) - centre * scale[j];
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
        group_scales(scales_zeros, groups, block_n, b, g, n, 8.0f, scale, shift);
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
/* The 32 codes of 16 bytes as floats: rows 0-15 from the low nibbles, 16-31 the high.
 * Each 8 bytes are zero-extended to 32-bit lanes straight from memory, then the low nibble
 * is an AND and the high one a shift (a byte's high nibble needs no mask): two shuffles for
 * 32 codes where widening the nibbles from a 16-byte register took six (two byte shifts and
 * four extensions). At one row of x the loop is bound by its vector ports, and on an AMD
 * EPYC (Zen 2) this read a 16384 x 2048 matrix 1.28x as fast on one core and 1.40x on two
 * (docs/benchmarks.md, "The int4 GEMV's AVX2 loop on an AMD EPYC"). What is left is about
 * one conversion and one FMA per 8 codes; a second chain of accumulators (FMA latency) and
 * floats made from the codes' bits instead of a conversion (1 + c/16, OR-ed into 1.0)
 * measured slower. */
static inline void unpack16(const uint8_t *run, __m256 c[4]) {
    const __m256i nibble = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)run));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(run + 8)));
    c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble));
    c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble));
    c[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

/* out[i][dst + r] += s * acc + shift * xsum for one row of x, 8 rows of W at a time. */
static inline void fold8(float *out, const float *scale, const float *shift, __m256 acc,
                         float xsum) {
    const __m256 t = _mm256_fmadd_ps(_mm256_loadu_ps(shift), _mm256_set1_ps(xsum),
                                     _mm256_loadu_ps(out));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_loadu_ps(scale), acc, t));
}

/* The runs of the group GEMV_PF_GROUPS ahead of the one at column k0, into L1. A block's runs
 * are one sequential stream, yet the hardware prefetcher did not keep ahead of the loops:
 * on a Xeon, when the AVX512 loop read each group in two interleaved passes, a 128256 x 2048
 * LM head read 13 GB/s without, 17 with 2 groups ahead (4, 8 and 16 between; in a whole
 * decode step 2, 6 and 12 alike); on a Zen 4, reading each group in one pass, a batch-1
 * step's products of Llama-3.2-1B's shape took 0.78-0.85x the time with them in 3 rounds of
 * 4 (1.17x in the fourth); and with AVX2's 32 on an AMD EPYC (Zen 2) the same
 * head read 15.4 GB/s without, 18.9 with, and a batch-1 step of Llama-3.2-1B's shape ran
 * 1.08x as fast (matrices of a few MB gain nothing: the caches hold them). A prefetch past
 * the block's end is harmless: prefetches never fault. */
#ifndef GEMV_PF_GROUPS
#define GEMV_PF_GROUPS 2
#endif
static inline void prefetch_group(const uint8_t *block, int64_t k0, int64_t group,
                                  int64_t half) {
    if (!GEMV_PF_GROUPS) return;
    const uint8_t *ahead = block + (k0 + GEMV_PF_GROUPS * group) * half;
    for (int64_t line = 0; line < group * half; line += 64)
        _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
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

/* R rows of x (4 or 6) against 16 rows of W: one nibble of a 16-byte chunk of the runs
 * (`high` 0 for the low nibbles, 1 for the high), its codes converted once for all R rows'
 * products where chunk_group's serve two. The conversion, not the FMAs, is what a row of x
 * costs beyond them: per weight and row of x on one core of an AMD EPYC (Zen 2), 72 ps
 * alone, 45 two rows at a time, 35 four, 30 six (on a Zen 3, before unpack16's zero-extension
 * from memory: 54 two, 41 four, 36 six, where a float32 GEMM over the widened matrix took 29).
 * Six rows' 12 accumulators, 2 code vectors and a broadcast fill AVX2's 16 registers. */
static inline __attribute__((always_inline)) void chunk16_rows(
    const uint8_t *run, int64_t half, int64_t group, const float *const x[6],
    float *const o[6], const float *scale, const float *shift, const float s[6], int64_t r,
    const int high, const int R) {
    const __m256i nibble = _mm256_set1_epi32(15);
    __m256 a[6][2];
    for (int i = 0; i < R; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < group; k++) {
        __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(run + k * half)));
        __m256i w1 =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(run + k * half + 8)));
        w0 = high ? _mm256_srli_epi32(w0, 4) : _mm256_and_si256(w0, nibble);
        w1 = high ? _mm256_srli_epi32(w1, 4) : _mm256_and_si256(w1, nibble);
        const __m256 c0 = _mm256_cvtepi32_ps(w0), c1 = _mm256_cvtepi32_ps(w1);
        for (int i = 0; i < R; i++) {
            const __m256 v = _mm256_broadcast_ss(x[i] + k);
            a[i][0] = _mm256_fmadd_ps(c0, v, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(c1, v, a[i][1]);
        }
    }
    for (int i = 0; i < R; i++) {
        fold8(o[i] + r, scale + r, shift + r, a[i][0], s[i]);
        fold8(o[i] + r + 8, scale + r + 8, shift + r + 8, a[i][1], s[i]);
    }
}

/* A full interleaved block (block_n 32 or 64): per group, per 16-byte chunk of the runs
 * (chunk q holds rows 16q.. in its low nibbles and half + 16q.. in its high), rows of x
 * six or four at a time, then two, then one. A group's runs are group * half bytes (1-2
 * KiB), so the chunks after the first read them from L1. */
static void block_avx2(const uint8_t *block, const uint16_t *scales_zeros, const float *x,
                       int64_t x_stride, const float *xsum, float *out, int64_t out_stride,
                       int64_t m, int64_t cols, int64_t planes, int64_t group, int64_t b,
                       int64_t block_n) {
    const int64_t width = planes * cols, groups = width / group, half = block_n / 2;
    float scale[MAX_BLOCK_N], shift[MAX_BLOCK_N];
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < block_n; j++) out[i * out_stride + j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        group_scales(scales_zeros, groups, block_n, b, g, block_n, 8.0f, scale, shift);
        const int64_t k0 = g * group, xk = k0 % cols; /* every plane multiplies the same x */
        prefetch_group(block, k0, group, half);
        for (int64_t q = 0; q < half / 16; q++) {
            const uint8_t *run = block + k0 * half + 16 * q;
            const int64_t r_lo = 16 * q, r_hi = half + 16 * q;
            int64_t i = 0;
            /* six rows at a time, four for what is left (eight: four and four, 41 ps
             * against six and two's 44), then two, then one */
            for (int64_t r; (r = m - i >= 6 && m - i != 8 ? 6 : 4) <= m - i; i += r) {
                const float *xs[6];
                float *os[6], ss[6];
                for (int64_t j = 0; j < r; j++) {
                    xs[j] = x + (i + j) * x_stride + xk;
                    os[j] = out + (i + j) * out_stride;
                    ss[j] = xsum[(i + j) * groups + g];
                }
                if (r == 6) {
                    chunk16_rows(run, half, group, xs, os, scale, shift, ss, r_lo, 0, 6);
                    chunk16_rows(run, half, group, xs, os, scale, shift, ss, r_hi, 1, 6);
                } else {
                    chunk16_rows(run, half, group, xs, os, scale, shift, ss, r_lo, 0, 4);
                    chunk16_rows(run, half, group, xs, os, scale, shift, ss, r_hi, 1, 4);
                }
            }
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* With AVX512 the float32 loop converts 16 codes an instruction where AVX2 converts 8: the
 * conversion is what the loop is bound by (block_avx2), so a row of x costs about half the
 * instructions. Same products, same order of sums per lane as chunk16_rows, 16 rows a
 * register instead of 8, with the groups ahead prefetched (prefetch_group). Measured on a
 * Xeon: a decode step of Llama-3.2-1B's shape 1.15x as fast as through torch's 512-bit int4
 * kernel; on an AMD EPYC (Zen 4), reading a block's whole run per column (block_rows512)
 * made that step's products 1.18x as fast at one row on two cores, 1.27x at eight
 * (docs/benchmarks.md, "The int4 GEMV's AVX512 loop on an AMD EPYC (Zen 4)"). */
static inline void fold16(float *out, const float *scale, const float *shift, __m512 acc,
                          float xsum) {
    const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(shift), _mm512_set1_ps(xsum),
                                     _mm512_loadu_ps(out));
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(scale), acc, t));
}

/* R rows of x (1-6) against a block of 64 rows: per column k its run of 32 bytes, two
 * 16-byte chunks, chunk j holding rows 16j.. in its low nibbles and 32 + 16j.. in its high,
 * each zero-extended to 32-bit lanes straight from memory (then an AND and a shift, as
 * unpack16). Six rows' 24 accumulators, 4 code vectors and a broadcast fill 29 of AVX512's
 * 32 registers. Against a 16-byte chunk at a time (two interleaved passes over each group's
 * runs, the nibbles split in a 128-bit register before two extensions), one row of x has
 * four independent chains of FMAs instead of two, and a 16384 x 2048 matrix read 1.18x as
 * fast on one core of a Zen 4 (51 -> 43 ps per weight), 1.14-1.16x at 2-6 rows; eight
 * chains (even and odd columns apart) gained nothing more. */
static inline __attribute__((always_inline)) void block_rows512(
    const uint8_t *run, int64_t group, const float *const x[6], float *const o[6],
    const float *scale, const float *shift, const float s[6], const int R) {
    const __m512i nibble = _mm512_set1_epi32(15);
    __m512 a[6][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < group; k++) {
        __m512 c[4]; /* rows 0.., 16.., 32.., 48.. */
        for (int j = 0; j < 2; j++) {
            const __m512i bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(run + 32 * k + 16 * j)));
            c[j] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble));
            c[2 + j] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        }
        for (int i = 0; i < R; i++) {
            const __m512 v = _mm512_set1_ps(x[i][k]);
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_fmadd_ps(c[j], v, a[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++)
            fold16(o[i] + 16 * j, scale + 16 * j, shift + 16 * j, a[i][j], s[i]);
}

/* block_avx2's loop over a block of 64 rows (AVX512's packing) with block_rows512: rows of
 * x six at a time, then what is left. */
static void block_avx512(const uint8_t *block, const uint16_t *scales_zeros, const float *x,
                         int64_t x_stride, const float *xsum, float *out, int64_t out_stride,
                         int64_t m, int64_t cols, int64_t planes, int64_t group, int64_t b) {
    const int64_t width = planes * cols, groups = width / group;
    float scale[64], shift[64];
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < 64; j++) out[i * out_stride + j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        group_scales(scales_zeros, groups, 64, b, g, 64, 8.0f, scale, shift);
        const int64_t k0 = g * group, xk = k0 % cols;
        const uint8_t *run = block + 32 * k0;
        prefetch_group(block, k0, group, 32);
        for (int64_t i = 0; i < m;) {
            const int64_t r = m - i >= 6 ? 6 : m - i;
            const float *xs[6];
            float *os[6], ss[6];
            for (int64_t j = 0; j < r; j++) {
                xs[j] = x + (i + j) * x_stride + xk;
                os[j] = out + (i + j) * out_stride;
                ss[j] = xsum[(i + j) * groups + g];
            }
            switch (r) { /* each a constant R: its own unrolled loop */
            case 6: block_rows512(run, group, xs, os, scale, shift, ss, 6); break;
            case 5: block_rows512(run, group, xs, os, scale, shift, ss, 5); break;
            case 4: block_rows512(run, group, xs, os, scale, shift, ss, 4); break;
            case 3: block_rows512(run, group, xs, os, scale, shift, ss, 3); break;
            case 2: block_rows512(run, group, xs, os, scale, shift, ss, 2); break;
            default: block_rows512(run, group, xs, os, scale, shift, ss, 1);
            }
            i += r;
        }
    }
}
#endif

/* sum c q of 8 rows as floats from int16 sums in both lanes (the same rows, other
 * columns), less offset (8 sum q: the codes centred). */
static inline __m256 widen_lanes(__m256i a, __m256i offset) {
    const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a));
    const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(lo, hi), offset));
}

/* The 32 rows of a block (block_n 32: runs of 16 bytes) for one row of x or (two) two, x as
 * int8. Four columns a step: A holds runs k and k+1, B runs k+2 and k+3, so unpacking A with
 * B pairs run k with k+2 in the low lane and k+1 with k+3 in the high one, a byte a row;
 * the activations are stored a quad at a time as (k, k+2, k+1, k+3) (quantize_rows), and
 * `pick` spreads the first pair over the low lane and the second over the high. Each
 * vpmaddubsw sum is at most 2 * 15 * 127, so 8 steps (QK columns) fit int16's range; then
 * both lanes widen to int32, add, and scale by the block's d into float. */
static inline __attribute__((always_inline)) void block_q8_rows(
    const uint8_t *block, const uint16_t *scales_zeros, const int8_t *q0, const int8_t *q1,
    const float *d0, const float *d1, const int32_t *qs0, const int32_t *qs1, const float *xs0,
    const float *xs1, float *o0, float *o1, int64_t cols, int64_t groups, int64_t group,
    int64_t b, const int two) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    float scale[32], zero[32];
    for (int j = 0; j < 32; j++) {
        o0[j] = 0.0f;
        if (two) o1[j] = 0.0f;
    }
    for (int64_t g = 0; g < groups; g++) {
        group_scales(scales_zeros, groups, 32, b, g, 32, 0.0f, scale, zero);
        const int64_t k0 = g * group, xk = k0 % cols;
        __m256 f0[4], f1[4];
        for (int r = 0; r < 4; r++) f0[r] = f1[r] = _mm256_setzero_ps();
        for (int64_t kb = 0; kb < group; kb += QK) {
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
            __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            const uint8_t *run = block + (k0 + kb) * 16;
            for (int k = 0; k < QK; k += 4) {
                const __m256i A = _mm256_loadu_si256((const __m256i *)(run + 16 * k));
                const __m256i B = _mm256_loadu_si256((const __m256i *)(run + 16 * k + 32));
                const __m256i ul = _mm256_unpacklo_epi8(A, B), uh = _mm256_unpackhi_epi8(A, B);
                const __m256i c0 = _mm256_and_si256(ul, nibble); /* rows 0-7 */
                const __m256i c1 = _mm256_and_si256(uh, nibble); /* rows 8-15 */
                const __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(ul, 4), nibble);
                const __m256i c3 = _mm256_and_si256(_mm256_srli_epi16(uh, 4), nibble);
                int32_t quad;
                memcpy(&quad, q0 + xk + kb + k, sizeof quad);
                const __m256i v0 = _mm256_shuffle_epi8(_mm256_set1_epi32(quad), pick);
                a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(c0, v0));
                a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(c1, v0));
                a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(c2, v0));
                a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(c3, v0));
                if (two) {
                    memcpy(&quad, q1 + xk + kb + k, sizeof quad);
                    const __m256i v1 = _mm256_shuffle_epi8(_mm256_set1_epi32(quad), pick);
                    b0 = _mm256_add_epi16(b0, _mm256_maddubs_epi16(c0, v1));
                    b1 = _mm256_add_epi16(b1, _mm256_maddubs_epi16(c1, v1));
                    b2 = _mm256_add_epi16(b2, _mm256_maddubs_epi16(c2, v1));
                    b3 = _mm256_add_epi16(b3, _mm256_maddubs_epi16(c3, v1));
                }
            }
            const int64_t db = (xk + kb) / QK;
            const __m256 s0 = _mm256_set1_ps(d0[db]);
            const __m256i e0 = _mm256_set1_epi32(8 * qs0[db]);
            f0[0] = _mm256_fmadd_ps(widen_lanes(a0, e0), s0, f0[0]);
            f0[1] = _mm256_fmadd_ps(widen_lanes(a1, e0), s0, f0[1]);
            f0[2] = _mm256_fmadd_ps(widen_lanes(a2, e0), s0, f0[2]);
            f0[3] = _mm256_fmadd_ps(widen_lanes(a3, e0), s0, f0[3]);
            if (two) {
                const __m256 s1 = _mm256_set1_ps(d1[db]);
                const __m256i e1 = _mm256_set1_epi32(8 * qs1[db]);
                f1[0] = _mm256_fmadd_ps(widen_lanes(b0, e1), s1, f1[0]);
                f1[1] = _mm256_fmadd_ps(widen_lanes(b1, e1), s1, f1[1]);
                f1[2] = _mm256_fmadd_ps(widen_lanes(b2, e1), s1, f1[2]);
                f1[3] = _mm256_fmadd_ps(widen_lanes(b3, e1), s1, f1[3]);
            }
        }
        for (int r = 0; r < 4; r++) {
            fold8(o0 + 8 * r, scale + 8 * r, zero + 8 * r, f0[r], xs0[g]);
            if (two) fold8(o1 + 8 * r, scale + 8 * r, zero + 8 * r, f1[r], xs1[g]);
        }
    }
}

/* A full block of 32 rows (the AVX2 layout), rows of x two at a time. */
static void block_q8(const uint8_t *block, const uint16_t *scales_zeros, const int8_t *q,
                     const float *d, const int32_t *qsum, const float *xsum, float *out,
                     int64_t out_stride, int64_t m, int64_t cols, int64_t planes, int64_t group,
                     int64_t b) {
    const int64_t groups = planes * cols / group, scales = cols / QK;
    int64_t i = 0;
    for (; i + 1 < m; i += 2)
        block_q8_rows(block, scales_zeros, q + i * cols, q + (i + 1) * cols, d + i * scales,
                      d + (i + 1) * scales, qsum + i * scales, qsum + (i + 1) * scales,
                      xsum + i * groups, xsum + (i + 1) * groups, out + i * out_stride,
                      out + (i + 1) * out_stride, cols, groups, group, b, 1);
    if (i < m)
        block_q8_rows(block, scales_zeros, q + i * cols, 0, d + i * scales, 0, qsum + i * scales,
                      0, xsum + i * groups, 0, out + i * out_stride, 0, cols, groups, group, b,
                      0);
}
#endif

/* Rows of x as int8, QK columns to a float scale d = amax / 127 (q = x / d, rounded half
 * away from zero), into q [m][cols] (and their sum per block into qsum) with each quad of
 * columns stored (k, k+2, k+1, k+3) (block_q8_rows), and the same values, d * q, as
 * float32 in column order into xq. */
static void quantize_rows(const float *x, int64_t x_stride, int64_t m, int64_t cols, int8_t *q,
                          float *d, int32_t *qsum, float *xq) {
    static const int order[4] = {0, 2, 1, 3};
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < cols / QK; b++) {
            const float *xb = x + i * x_stride + b * QK;
            float amax = 0.0f; /* NaN once any is NaN, so a NaN or inf in x stays non-finite
                                * in out (d NaN or inf), as the float32 loop's does */
            for (int k = 0; k < QK; k++) {
                const float a = xb[k] < 0.0f ? -xb[k] : xb[k];
                amax = (a > amax || a != a) ? a : amax;
            }
            const float scale = amax / 127.0f, inverse = amax > 0.0f ? 1.0f / scale : 0.0f;
            d[i * (cols / QK) + b] = scale;
            int32_t total = 0;
            for (int k = 0; k < QK; k++) {
                const float v = xb[k] * inverse;
                int r = (int)(v + (v < 0.0f ? -0.5f : 0.5f));
                r = r > 127 ? 127 : (r < -127 ? -127 : r);
                q[i * cols + b * QK + (k & ~3) + order[k & 3]] = (int8_t)r;
                xq[i * cols + b * QK + k] = scale * (float)r;
                total += r;
            }
            qsum[i * (cols / QK) + b] = total;
        }
}

/* out[i][n - row0] = sum_k W[n, k] x[i][k] for i < m and row0 <= n < row1 (row0 a multiple
 * of block_n; row1 a multiple of block_n or the matrix's padded rows), on `threads` threads;
 * scales_zeros block-major (group_scales); with int8_x, x rounded to int8 as the header
 * says (cols a multiple of QK). Returns 0, -1 for arguments past the fixed buffers (native.py
 * checks them first), or -2 when memory for the int8 rows is not there. */
int gemv_int4(const uint8_t *packed, const uint16_t *scales_zeros, const float *x,
              int64_t x_stride, float *out, int64_t out_stride, int64_t m,
              int64_t cols, int64_t planes, int64_t group, int64_t block_n,
              int32_t interleaved, int64_t row0, int64_t row1, int32_t threads,
              int32_t int8_x) {
    const int64_t width = planes * cols, groups = width / group;
    if (m > MAX_ROWS || block_n > MAX_BLOCK_N || groups > MAX_GROUPS || width % group) return -1;
    if (int8_x && cols % QK) return -1;
    int8_t *q = 0;
    int32_t *qsum = 0;
    float *d = 0, *xq = 0;
    if (int8_x) { /* from here on, x is xq */
        q = malloc((size_t)(m * cols));
        d = malloc(sizeof(float) * (size_t)(m * (cols / QK)));
        qsum = malloc(sizeof(int32_t) * (size_t)(m * (cols / QK)));
        xq = malloc(sizeof(float) * (size_t)(m * cols));
        if (!q || !d || !qsum || !xq) {
            free(q), free(d), free(qsum), free(xq);
            return -2;
        }
        quantize_rows(x, x_stride, m, cols, q, d, qsum, xq);
        x = xq, x_stride = cols;
    }
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
        const int avx = n == block_n && interleaved && cols % group == 0;
        if (int8_x && avx && block_n == 32 && group % QK == 0) {
            block_q8(block, scales_zeros, q, d, qsum, sums, o, out_stride, m, cols, planes, group,
                     first / block_n);
            continue;
        }
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (avx && block_n == 64) {
            block_avx512(block, scales_zeros, x, x_stride, sums, o, out_stride, m, cols, planes,
                         group, first / block_n);
            continue;
        }
#endif
        if (avx && block_n % 32 == 0) {
            block_avx2(block, scales_zeros, x, x_stride, sums, o, out_stride, m, cols, planes,
                       group, first / block_n, block_n);
            continue;
        }
#endif
        block_scalar(block, scales_zeros, x, x_stride, sums, o, out_stride, m, cols, planes,
                     group, first / block_n, block_n, n, interleaved && n == block_n);
    }
    free(q), free(d), free(qsum), free(xq);
    return 0;
}
