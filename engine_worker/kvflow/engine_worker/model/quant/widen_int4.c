/* Widen rows of an int4 matrix packed for torch's CPU kernel into W.T, bf16 or float32.
 *
 * torch's eager ops widen at 1.5-2 ns a weight (five passes: unpack, convert, scale,
 * shift, each one element at a time through a bf16 round trip); this one pass runs at about
 * 0.2 ns on one core with AVX512 (0.3 without), which is what makes a bf16 GEMM over quantized weights beat the int4 kernel from
 * about 16 rows of activations on (int4_weight.py). Compiled on first use by native.py;
 * without a C compiler kvflow widens with torch ops instead.
 *
 * The packed layout (cpu_layout.py): block b of block_n rows starts at byte
 * b * width * block_n / 2 and holds one run of block_n / 2 bytes per column; in an
 * interleaved block row j of the block is byte j % (block_n / 2), nibble j / (block_n / 2);
 * otherwise rows 2i and 2i + 1 share byte i. Only full blocks are widened here.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; weights are finite */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* out[k][n - row0] = sum over planes p of (code(n, p * cols + k) - 8) * s + z, for
 * k < cols and row0 <= n < row1 (both multiples of block_n): W.T, its rows out_stride
 * elements apart, bf16 or (out_f32) float32. scales_zeros holds bf16 pairs (scale, zero):
 * group g's of row j of block b is pair g * group_stride + b * block_stride + j (torch's
 * layout [groups][rows]: padded_rows and block_n; block-major [blocks][groups][block_n]:
 * block_n and groups * block_n).
 *
 * Loop order: a block at a time (its bytes are one contiguous run); the block's scales
 * widened once into floats (with the zero folded in: (c - 8) s + z = c s + (z - 8 s)); then
 * per column the block's rows in a branch-free inner loop the compiler vectorizes, the
 * planes summed in floats and rounded once. W.T is what the packed bytes give without a
 * transpose (a block's column is one run); the caller keeps out's rows short (1 Ki
 * elements) so that a block's writes stay on few pages. */
#define MAX_BLOCK_N 64
#define MAX_GROUPS 4096

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* One 64-row block of an AVX512 build's layout, four vectors of 16 rows: byte d of a run
 * holds rows d (low nibble) and 32 + d (high), byte 16 + d rows 16 + d and 48 + d. The
 * generic loop below does the same at about 1 cycle a weight; this, about a third of it. */
static void widen_block_avx512(const uint8_t *block, const float (*scale)[MAX_BLOCK_N],
                               const float (*shift)[MAX_BLOCK_N], void *out, int32_t out_f32,
                               int64_t out_stride, int64_t first_col, int64_t cols,
                               int64_t planes, int64_t group) {
    const __m128i nibble = _mm_set1_epi8(15);
    for (int64_t k = 0; k < cols; k++) {
        __m512 v[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
        for (int64_t p = 0; p < planes; p++) {
            const int64_t kk = p * cols + k;
            const uint8_t *run = block + kk * 32;
            const float *s = scale[kk / group], *t = shift[kk / group];
            const __m128i first = _mm_loadu_si128((const __m128i *)run);
            const __m128i second = _mm_loadu_si128((const __m128i *)(run + 16));
            const __m128i codes[4] = {
                _mm_and_si128(first, nibble), _mm_and_si128(second, nibble),
                _mm_and_si128(_mm_srli_epi16(first, 4), nibble),
                _mm_and_si128(_mm_srli_epi16(second, 4), nibble)};
            for (int q = 0; q < 4; q++) {
                const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes[q]));
                v[q] = _mm512_add_ps(
                    v[q], _mm512_fmadd_ps(c, _mm512_loadu_ps(s + 16 * q), _mm512_loadu_ps(t + 16 * q)));
            }
        }
        const int64_t dst = k * out_stride + first_col;
        for (int q = 0; q < 4; q++) {
            if (out_f32) {
                _mm512_storeu_ps((float *)out + dst + 16 * q, v[q]);
            } else { /* round to nearest even, as to_bf16 */
                __m512i u = _mm512_castps_si512(v[q]);
                const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + dst + 16 * q),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
            }
        }
    }
}
#endif

void widen_int4(const uint8_t *packed, const uint16_t *scales_zeros, void *out,
                int32_t out_f32, int64_t out_stride, int64_t group_stride, int64_t block_stride,
                int64_t cols,
                int64_t planes, int64_t group, int64_t block_n, int32_t interleaved, int64_t row0,
                int64_t row1) {
    const int64_t width = planes * cols, half = block_n / 2, groups = width / group;
    static _Thread_local float scale[MAX_GROUPS][MAX_BLOCK_N], shift[MAX_GROUPS][MAX_BLOCK_N];
    if (block_n > MAX_BLOCK_N || groups > MAX_GROUPS) return; /* native.py checks both */
    for (int64_t b = row0 / block_n; b < row1 / block_n; b++) {
        const uint8_t *block = packed + b * width * half;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *sz = scales_zeros + (g * group_stride + b * block_stride) * 2;
            for (int64_t j = 0; j < block_n; j++) {
                scale[g][j] = from_bf16(sz[2 * j]);
                shift[g][j] = from_bf16(sz[2 * j + 1]) - 8.0f * scale[g][j];
            }
        }
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (interleaved && block_n == 64) {
            widen_block_avx512(block, (const float(*)[MAX_BLOCK_N])scale,
                               (const float(*)[MAX_BLOCK_N])shift, out, out_f32,
                               out_stride, b * block_n - row0, cols, planes, group);
            continue;
        }
#endif
        for (int64_t k = 0; k < cols; k++) {
            float vals[MAX_BLOCK_N];
            for (int64_t j = 0; j < MAX_BLOCK_N; j++) vals[j] = 0.0f;
            for (int64_t p = 0; p < planes; p++) {
                const int64_t kk = p * cols + k, g = kk / group;
                const uint8_t *restrict run = block + kk * half;
                const float *restrict s = scale[g], *restrict t = shift[g];
                if (interleaved) { /* row j: byte j % half, the high nibble from half on */
                    for (int64_t j = 0; j < half; j++) vals[j] += (float)(run[j] & 15) * s[j] + t[j];
                    for (int64_t j = 0; j < half; j++)
                        vals[half + j] += (float)(run[j] >> 4) * s[half + j] + t[half + j];
                } else { /* rows 2i and 2i + 1: byte i */
                    for (int64_t i = 0; i < half; i++) {
                        vals[2 * i] += (float)(run[i] & 15) * s[2 * i] + t[2 * i];
                        vals[2 * i + 1] += (float)(run[i] >> 4) * s[2 * i + 1] + t[2 * i + 1];
                    }
                }
            }
            const int64_t dst = k * out_stride + (b * block_n - row0);
            if (out_f32) {
                memcpy((float *)out + dst, vals, (size_t)block_n * sizeof(float));
            } else {
                uint16_t *restrict o = (uint16_t *)out + dst;
                for (int64_t j = 0; j < block_n; j++) o[j] = to_bf16(vals[j]);
            }
        }
    }
}
