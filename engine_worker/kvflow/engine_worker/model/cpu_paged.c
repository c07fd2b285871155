/* Decode attention on the CPU that reads K/V straight from the paged cache: one query token
 * per sequence over its own context, through its block table, in float32 whatever the
 * cache stores (float32, bf16, or int8 / fp8 e4m3 rows with a float16 scale each).
 *
 * The torch path gathers each sequence's blocks (or keeps dense copies of them, the decode
 * workspace) and calls SDPA over a batch padded to its longest context: at a decode step's
 * shapes SDPA's per-call cost (tens of us for a few small products per head) and the
 * padding are most of attention's time. Here each (sequence, KV head) is one task: the
 * H / Hkv query heads that share the KV head are attended together, so a K/V row is read
 * once (GQA), and only the sequence's own tokens are read, where the cache holds them.
 *
 * Per task, three passes: scores (q . k, scaled) into a buffer of context-length floats per
 * query head, then exp against the head's max and the sum, then the weighted sum of V.
 * A two-pass softmax rather than an online one: a decode context's scores fit in L2, and
 * each pass vectorizes with no rescaling per token. With fewer tasks than two a thread
 * (batch 1), each context is cut into splits attended apart and merged by their maxes and
 * sums, as flash-decoding does on GPUs.
 *
 * The cache: [blocks, block_size, 2, num_kv_heads, row], a token's K and V side by side,
 * strides in bytes (paged_cache.py). A row is head_dim values of the cache's kind; a
 * quantized row ends in its float16 scale (kv_quant.py), which multiplies the row's dot
 * product and its probability rather than each value. Each kind's passes are the same
 * code, specialised by a constant (KIND_*), so no load branches.
 *
 * Threads: OpenMP over tasks; the library links libgomp.so.1 by soname like gemv_int4.c,
 * so in torch's process it shares torch's runtime (cpu_paged.py runs it on one thread
 * where it could not). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 lanes, 32 registers: the scores and values passes below load and widen each K/V row
 * once for all the query heads of its KV head (up to 3 and 4 at a time), where AVX2's 16
 * registers make them do it once per head. For the narrow kinds (bf16, int8, fp8), whose
 * widening is most of a load: 1.3-2.0x AVX2's speed on a Xeon with AMX. Not for float32,
 * whose rows need no widening: there it measured 0.82-1.10x, slower over the longest
 * batches, so float32 keeps AVX2's passes (docs/benchmarks.md). */
#define PAGED_AVX512 1
#endif
#endif

/* Query heads per KV head a call takes (Llama-3-70B: 8; cpu_paged.py checks). */
#define MAX_GROUP 16
/* Fewer (sequence, KV head) tasks than two a thread (batch 1 has as many as KV heads) cut
 * each context into splits of at least this many tokens, merged by their maxes and sums
 * (flash-decoding): a split costs its merge, worth it only over a few hundred tokens. */
#define MIN_SPLIT_TOKENS 256
#define MAX_SPLITS 64

/* What a cache row holds (cpu_paged.py's KINDS). */
#define KIND_F32 0
#define KIND_BF16 1
#define KIND_INT8 2
#define KIND_FP8 3 /* e4m3fn */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* One value of a row, as float32. fp8: the 7 bits below the sign shifted into a float32's
 * exponent and mantissa give 2^-120 of the value (normals and subnormals alike); the
 * product restores it, exactly. */
ALWAYS_INLINE float load1(const uint8_t *row, int64_t i, const int kind) {
    if (kind == KIND_F32) {
        float f;
        memcpy(&f, row + 4 * i, 4);
        return f;
    }
    if (kind == KIND_INT8) return (float)(int8_t)row[i];
    uint32_t bits;
    if (kind == KIND_BF16) {
        uint16_t h;
        memcpy(&h, row + 2 * i, 2);
        bits = (uint32_t)h << 16;
    } else {
        bits = (uint32_t)(row[i] & 0x7F) << 20;
    }
    float f;
    memcpy(&f, &bits, 4);
    if (kind == KIND_FP8) {
        f *= 0x1p120f;
        if (row[i] & 0x80) f = -f;
    }
    return f;
}

/* A quantized row's scale: the float16 after its head_dim values; 1 for the others. */
ALWAYS_INLINE float row_scale(const uint8_t *row, int64_t head_dim, const int kind) {
    if (kind != KIND_INT8 && kind != KIND_FP8) return 1.0f;
    uint16_t h;
    memcpy(&h, row + head_dim, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man x 2^-24 */
        const float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef PAGED_AVX2
static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* Values i..i+7 of a row, as float32. */
ALWAYS_INLINE __m256 load8(const uint8_t *row, int64_t i, const int kind) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)row + i);
    if (kind == KIND_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    const __m128i b = _mm_loadl_epi64((const __m128i *)(row + i));
    if (kind == KIND_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256i u = _mm256_cvtepu8_epi32(b);
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

/* e^x for 8 floats, within 2 ulp of expf for x in [-87, 88] (Cephes' polynomial on x - n ln 2);
 * below -87, 0 (a probability under e^-87 of the row's largest is 0 in float32 anyway). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln 2, ln 2 in two parts so that r is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                            _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* The 8 sums across the lanes of a[0..7], as one vector: a tree of horizontal adds. */
ALWAYS_INLINE __m256 sums8(const __m256 *a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#ifdef PAGED_AVX512
/* Values i..i+15 of a row, as float32 (load8's widening, 16 lanes). */
ALWAYS_INLINE __m512 load16(const uint8_t *row, int64_t i, const int kind) {
    if (kind == KIND_F32) return _mm512_loadu_ps((const float *)row + i);
    if (kind == KIND_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)(row + i));
    if (kind == KIND_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m512i u = _mm512_cvtepu8_epi32(b);
    const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7F)), 20);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
    const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

/* The 16 lanes of v added into 8. */
ALWAYS_INLINE __m256 fold16(__m512 v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
}

#endif

/* The rows of tokens t0..t0+n-1 (K's, or V's with the cache pointer past K) through the block
 * table: a tile's pointers, so the passes divide by the block size once per tile. */
#define TILE 32
static void tile_rows(const uint8_t *cache, int64_t stride_block, int64_t stride_token,
                      const int64_t *table, int64_t block_size, int64_t t0, int64_t n,
                      const uint8_t **rows) {
    int64_t block = t0 / block_size, offset = t0 % block_size;
    const uint8_t *row = cache + table[block] * stride_block + offset * stride_token;
    for (int64_t j = 0; j < n; j++) {
        if (offset == block_size) {
            row = cache + table[++block] * stride_block;
            offset = 0;
        }
        rows[j] = row;
        row += stride_token;
        offset++;
    }
}

/* Asks for the rows of tokens t0..t0+n-1 (K's or V's, as tile_rows) to be brought into the
 * caches while the tile before them is worked on: a block's rows are a stride apart, which
 * the hardware prefetcher follows, but the next block is anywhere in the cache. */
static void prefetch_rows(const uint8_t *cache, int64_t stride_block, int64_t stride_token,
                          const int64_t *table, int64_t block_size, int64_t t0, int64_t n,
                          int64_t bytes) {
#ifndef PAGED_NO_PREFETCH
    int64_t block = t0 / block_size, offset = t0 % block_size;
    const uint8_t *row = cache + table[block] * stride_block + offset * stride_token;
    for (int64_t j = 0; j < n; j++) {
        if (offset == block_size) {
            row = cache + table[++block] * stride_block;
            offset = 0;
        }
        for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at, 0, 3);
        row += stride_token;
        offset++;
    }
#else
    (void)cache, (void)stride_block, (void)stride_token, (void)table, (void)block_size;
    (void)t0, (void)n, (void)bytes;
#endif
}

/* The bytes of a row of `kind`: head_dim values, and a quantized row's float16 scale. */
ALWAYS_INLINE int64_t row_bytes(int64_t head_dim, const int kind) {
    if (kind == KIND_F32) return 4 * head_dim;
    if (kind == KIND_BF16) return 2 * head_dim;
    return head_dim + 2;
}

/* One task's geometry: where its K rows (V's are stride_kv bytes on) and query heads are,
 * and its tokens: first..first+len-1 of the sequence (all of them, or one split). */
typedef struct {
    const uint8_t *keys;
    int64_t stride_block, stride_token, stride_kv;
    const int64_t *table;
    int64_t first, len, block_size, group, head_dim;
    const float *q;
    int64_t q_stride_h;
    float scale;
} Task;

#ifdef PAGED_AVX512
/* Scores of tokens j..j+7 (rows) for query heads g0..g0+gb-1 (gb <= 3: 8 x 3 accumulators
 * and the row in registers): each 16 values of a K row loaded and widened once for the gb
 * heads, then per head the 8 tokens' lanes summed by fold16 and the hadd tree. */
ALWAYS_INLINE void scores8_avx512(const Task *k, const uint8_t *const *rows,
                                  const float *scales, float *scores, int64_t longest,
                                  int64_t t, int64_t g0, const int gb, __m256 *top,
                                  const int kind) {
    __m512 a[3][8];
    for (int g = 0; g < gb; g++)
        for (int r = 0; r < 8; r++) a[g][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k->head_dim; i += 16) {
        for (int r = 0; r < 8; r++) {
            const __m512 x = load16(rows[r], i, kind);
            for (int g = 0; g < gb; g++) {
                const __m512 qg = _mm512_loadu_ps(k->q + (g0 + g) * k->q_stride_h + i);
                a[g][r] = _mm512_fmadd_ps(qg, x, a[g][r]);
            }
        }
    }
    const __m256 sc = _mm256_loadu_ps(scales);
    for (int g = 0; g < gb; g++) {
        __m256 f[8];
        for (int r = 0; r < 8; r++) f[r] = fold16(a[g][r]);
        const __m256 scaled = _mm256_mul_ps(sums8(f), sc);
        _mm256_storeu_ps(scores + (g0 + g) * longest + t, scaled);
        top[g0 + g] = _mm256_max_ps(top[g0 + g], scaled);
    }
}

/* acc[g] += sum_j p_g[j] scales[j] v_j for query heads g0..g0+gb-1 (gb <= 4) over a tile's
 * n rows, 32 values at a time: each V row's values loaded and widened once for the gb
 * heads, whose 2 x gb accumulators stay in registers across the tile. */
ALWAYS_INLINE void values_avx512(const Task *k, const uint8_t *const *rows, const float *scales,
                                 int64_t n, const float *scores, int64_t longest, int64_t t0,
                                 float *acc, int64_t g0, const int gb, const int kind) {
    const int64_t head_dim = k->head_dim;
    for (int64_t i = 0; i < head_dim; i += 32) {
        __m512 a[4][2];
        for (int g = 0; g < gb; g++) {
            a[g][0] = _mm512_loadu_ps(acc + (g0 + g) * head_dim + i);
            a[g][1] = _mm512_loadu_ps(acc + (g0 + g) * head_dim + i + 16);
        }
        for (int64_t j = 0; j < n; j++) {
            const __m512 v0 = load16(rows[j], i, kind), v1 = load16(rows[j], i + 16, kind);
            for (int g = 0; g < gb; g++) {
                const __m512 pj = _mm512_set1_ps(scores[(g0 + g) * longest + t0 + j] * scales[j]);
                a[g][0] = _mm512_fmadd_ps(pj, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(pj, v1, a[g][1]);
            }
        }
        for (int g = 0; g < gb; g++) {
            _mm512_storeu_ps(acc + (g0 + g) * head_dim + i, a[g][0]);
            _mm512_storeu_ps(acc + (g0 + g) * head_dim + i + 16, a[g][1]);
        }
    }
}
#endif

/* scores[g][t] = q_g . k_t * scale for the task's tokens; the max of each head's in maxes. */
ALWAYS_INLINE void scores_pass(const Task *k, float *scores, int64_t longest, float *maxes,
                               const int kind) {
    const uint8_t *rows[TILE];
    const int64_t head_dim = k->head_dim;
    for (int64_t g = 0; g < k->group; g++) maxes[g] = -INFINITY;
    for (int64_t t0 = 0; t0 < k->len; t0 += TILE) {
        const int64_t n = k->len - t0 < TILE ? k->len - t0 : TILE;
        tile_rows(k->keys, k->stride_block, k->stride_token, k->table, k->block_size,
                  k->first + t0, n, rows);
        if (t0 + TILE < k->len) {
            const int64_t next = k->len - t0 - TILE < TILE ? k->len - t0 - TILE : TILE;
            prefetch_rows(k->keys, k->stride_block, k->stride_token, k->table, k->block_size,
                          k->first + t0 + TILE, next, row_bytes(head_dim, kind));
        }
        float scales[TILE];
        for (int64_t j = 0; j < n; j++) scales[j] = k->scale * row_scale(rows[j], head_dim, kind);
        /* The tile's last 8 tokens padded with copies of its last row: the vector loops take
         * a tail of 1-7 tokens as 8 (their copies' scores, written past the task's tokens into
         * the buffer's padding, are never read, and equal a real score, so the max holds),
         * where a scalar loop would cost as much as a tile's vector work. */
        const int64_t n8 = (n + 7) & ~(int64_t)7;
        for (int64_t j = n; j < n8; j++) {
            rows[j] = rows[n - 1];
            scales[j] = scales[n - 1];
        }
        int64_t done = 0; /* tokens of the tile scored for every head */
#ifdef PAGED_AVX512
        if (kind != KIND_F32 && head_dim % 16 == 0) {
            __m256 top[MAX_GROUP];
            for (int64_t g = 0; g < k->group; g++) top[g] = _mm256_set1_ps(maxes[g]);
            for (; done < n8; done += 8) {
                for (int64_t g0 = 0; g0 < k->group; g0 += 3) {
                    const int64_t gb = k->group - g0 < 3 ? k->group - g0 : 3;
                    const uint8_t *const *r8 = rows + done;
                    const float *s8 = scales + done;
                    if (gb == 3)
                        scores8_avx512(k, r8, s8, scores, longest, t0 + done, g0, 3, top, kind);
                    else if (gb == 2)
                        scores8_avx512(k, r8, s8, scores, longest, t0 + done, g0, 2, top, kind);
                    else
                        scores8_avx512(k, r8, s8, scores, longest, t0 + done, g0, 1, top, kind);
                }
            }
            for (int64_t g = 0; g < k->group; g++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, top[g]);
                for (int r = 0; r < 8; r++)
                    if (lanes[r] > maxes[g]) maxes[g] = lanes[r];
            }
        }
#endif
        for (int64_t g = 0; g < k->group; g++) {
            const float *qg = k->q + g * k->q_stride_h;
            float *s = scores + g * longest + t0;
            int64_t j = done;
#ifdef PAGED_AVX2
            if (head_dim % 8 == 0) {
                /* 8 tokens at once: 8 running products, summed across by a tree of hadds
                 * into one vector of their 8 scores */
                __m256 top = _mm256_set1_ps(maxes[g]);
                for (; j < n8; j += 8) {
                    __m256 a[8];
                    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                    for (int64_t i = 0; i < head_dim; i += 8) {
                        const __m256 x = _mm256_loadu_ps(qg + i);
                        for (int r = 0; r < 8; r++)
                            a[r] = _mm256_fmadd_ps(x, load8(rows[j + r], i, kind), a[r]);
                    }
                    const __m256 scaled = _mm256_mul_ps(sums8(a), _mm256_loadu_ps(scales + j));
                    _mm256_storeu_ps(s + j, scaled);
                    top = _mm256_max_ps(top, scaled);
                }
                float lanes[8];
                _mm256_storeu_ps(lanes, top);
                for (int r = 0; r < 8; r++)
                    if (lanes[r] > maxes[g]) maxes[g] = lanes[r];
            }
#endif
            for (; j < n; j++) {
                float dot = 0.0f;
                for (int64_t i = 0; i < head_dim; i++) dot += qg[i] * load1(rows[j], i, kind);
                s[j] = dot * scales[j];
                if (s[j] > maxes[g]) maxes[g] = s[j];
            }
        }
    }
}

/* scores[g][t] = e^(scores[g][t] - maxes[g]); returns their sums in sums. */
static void exp_pass(float *scores, int64_t longest, int64_t len, int64_t group,
                     const float *maxes, float *sums) {
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * longest;
        int64_t t = 0;
        float sum = 0.0f;
#ifdef PAGED_AVX2
        const __m256 m = _mm256_set1_ps(maxes[g]);
        __m256 acc = _mm256_setzero_ps();
        for (; t + 8 <= len; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
            _mm256_storeu_ps(s + t, e);
            acc = _mm256_add_ps(acc, e);
        }
        sum = hsum8(acc);
#endif
        for (; t < len; t++) {
            s[t] = expf(s[t] - maxes[g]);
            sum += s[t];
        }
        sums[g] = sum;
    }
}

/* acc[g] = sum_t scores[g][t] v_t, over the task's tokens: per tile, each head's
 * accumulators stay in registers across the tile's tokens (its V rows stay in L1). */
ALWAYS_INLINE void values_pass(const Task *k, const float *scores, int64_t longest, float *acc,
                               const int kind) {
    const uint8_t *rows[TILE];
    const int64_t head_dim = k->head_dim;
    for (int64_t i = 0; i < k->group * head_dim; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < k->len; t0 += TILE) {
        const int64_t n = k->len - t0 < TILE ? k->len - t0 : TILE;
        tile_rows(k->keys + k->stride_kv, k->stride_block, k->stride_token, k->table,
                  k->block_size, k->first + t0, n, rows);
        if (t0 + TILE < k->len) {
            const int64_t next = k->len - t0 - TILE < TILE ? k->len - t0 - TILE : TILE;
            prefetch_rows(k->keys + k->stride_kv, k->stride_block, k->stride_token, k->table,
                          k->block_size, k->first + t0 + TILE, next, row_bytes(head_dim, kind));
        }
        float scales[TILE];
        for (int64_t j = 0; j < n; j++) scales[j] = row_scale(rows[j], head_dim, kind);
#ifdef PAGED_AVX512
        if (kind != KIND_F32 && head_dim % 32 == 0) {
            for (int64_t g0 = 0; g0 < k->group; g0 += 4) {
                const int64_t gb = k->group - g0 < 4 ? k->group - g0 : 4;
                if (gb == 4)
                    values_avx512(k, rows, scales, n, scores, longest, t0, acc, g0, 4, kind);
                else if (gb == 3)
                    values_avx512(k, rows, scales, n, scores, longest, t0, acc, g0, 3, kind);
                else if (gb == 2)
                    values_avx512(k, rows, scales, n, scores, longest, t0, acc, g0, 2, kind);
                else
                    values_avx512(k, rows, scales, n, scores, longest, t0, acc, g0, 1, kind);
            }
            continue;
        }
#endif
        for (int64_t g = 0; g < k->group; g++) {
            const float *p = scores + g * longest + t0;
            float *a = acc + g * head_dim;
            int64_t i = 0;
#ifdef PAGED_AVX2
            for (; i + 32 <= head_dim; i += 32) {
                __m256 a0 = _mm256_loadu_ps(a + i), a1 = _mm256_loadu_ps(a + i + 8);
                __m256 a2 = _mm256_loadu_ps(a + i + 16), a3 = _mm256_loadu_ps(a + i + 24);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 pj = _mm256_set1_ps(p[j] * scales[j]);
                    a0 = _mm256_fmadd_ps(pj, load8(rows[j], i, kind), a0);
                    a1 = _mm256_fmadd_ps(pj, load8(rows[j], i + 8, kind), a1);
                    a2 = _mm256_fmadd_ps(pj, load8(rows[j], i + 16, kind), a2);
                    a3 = _mm256_fmadd_ps(pj, load8(rows[j], i + 24, kind), a3);
                }
                _mm256_storeu_ps(a + i, a0);
                _mm256_storeu_ps(a + i + 8, a1);
                _mm256_storeu_ps(a + i + 16, a2);
                _mm256_storeu_ps(a + i + 24, a3);
            }
#endif
            for (; i < head_dim; i++) {
                float sum = a[i];
                for (int64_t j = 0; j < n; j++) sum += p[j] * scales[j] * load1(rows[j], i, kind);
                a[i] = sum;
            }
        }
    }
}

/* One task's three passes for a cache of `kind`. Whole: out gets the group's head_dim
 * outputs. A split (partial not NULL): partial gets, per query head, its max, its sum and
 * its unnormalised head_dim outputs (PARTIAL floats), for the merge. */
#define PARTIAL(head_dim) ((head_dim) + 2)
ALWAYS_INLINE void attend(const Task *k, float *scores, int64_t stride, float *out,
                          int64_t out_stride_h, float *partial, const int kind) {
    float maxes[MAX_GROUP], sums[MAX_GROUP];
    float *acc = scores + k->group * stride;
    const int64_t head_dim = k->head_dim;
    if (k->len == 0) { /* a split past a short sequence's end: weighs nothing */
        for (int64_t g = 0; g < k->group; g++) {
            partial[g * PARTIAL(head_dim)] = -INFINITY;
            partial[g * PARTIAL(head_dim) + 1] = 0.0f;
        }
        return;
    }
    scores_pass(k, scores, stride, maxes, kind);
    exp_pass(scores, stride, k->len, k->group, maxes, sums);
    values_pass(k, scores, stride, acc, kind);
    for (int64_t g = 0; g < k->group; g++) {
        if (partial != NULL) {
            float *p = partial + g * PARTIAL(head_dim);
            p[0] = maxes[g];
            p[1] = sums[g];
            memcpy(p + 2, acc + g * head_dim, sizeof(float) * (size_t)head_dim);
            continue;
        }
        float *o = out + g * out_stride_h;
        const float inv = 1.0f / sums[g];
        for (int64_t i = 0; i < head_dim; i++) o[i] = acc[g * head_dim + i] * inv;
    }
}

typedef void (*Attend)(const Task *, float *, int64_t, float *, int64_t, float *);
static void attend_f32(const Task *k, float *s, int64_t n, float *o, int64_t h, float *p) {
    attend(k, s, n, o, h, p, KIND_F32);
}
static void attend_bf16(const Task *k, float *s, int64_t n, float *o, int64_t h, float *p) {
    attend(k, s, n, o, h, p, KIND_BF16);
}
static void attend_int8(const Task *k, float *s, int64_t n, float *o, int64_t h, float *p) {
    attend(k, s, n, o, h, p, KIND_INT8);
}
static void attend_fp8(const Task *k, float *s, int64_t n, float *o, int64_t h, float *p) {
    attend(k, s, n, o, h, p, KIND_FP8);
}

/* One query head's output from its splits' partials (PARTIAL floats each, `step` apart):
 * each split's outputs weighed by e^(its max - the largest max), over the same sum. */
static void merge(const float *partial, int64_t splits, int64_t step, int64_t head_dim,
                  float *out) {
    float top = -INFINITY;
    for (int64_t s = 0; s < splits; s++)
        if (partial[s * step + 1] > 0.0f && partial[s * step] > top) top = partial[s * step];
    float sum = 0.0f;
    for (int64_t i = 0; i < head_dim; i++) out[i] = 0.0f;
    for (int64_t s = 0; s < splits; s++) {
        const float *p = partial + s * step;
        if (p[1] == 0.0f) continue;
        const float w = expf(p[0] - top);
        sum += w * p[1];
        for (int64_t i = 0; i < head_dim; i++) out[i] += w * p[2 + i];
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < head_dim; i++) out[i] *= inv;
}

/* out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b for each sequence b of `batch`, K_b and V_b
 * its first lens[b] tokens through tables[b], in a cache of `kind` (KIND_*; strides in
 * bytes). q and out are float32 (strides in floats). Returns 0, -1 for arguments it does
 * not take (a group over MAX_GROUP, an unknown kind), -2 when the score buffer cannot be
 * allocated. */
int paged_decode(const float *q, int64_t q_stride_b, int64_t q_stride_h, const uint8_t *cache,
                 int64_t stride_block, int64_t stride_token, int64_t stride_kv,
                 int64_t stride_head, int32_t kind, const int64_t *tables, int64_t table_stride,
                 const int64_t *lens, float *out, int64_t out_stride_b, int64_t out_stride_h,
                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, float scale, int32_t threads) {
    const Attend kinds[] = {attend_f32, attend_bf16, attend_int8, attend_fp8};
    const int64_t group = num_heads / num_kv_heads;
    if (group < 1 || group > MAX_GROUP || kind < 0 || kind > KIND_FP8) return -1;
    const Attend run = kinds[kind];
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++)
        if (lens[b] > longest) longest = lens[b];
    const int64_t pairs = batch * num_kv_heads; /* (sequence, KV head) */
    int64_t splits = 1;
    if (threads > 1 && pairs < 2 * threads) {
        splits = (2 * threads + pairs - 1) / pairs;
        const int64_t most = longest / MIN_SPLIT_TOKENS;
        splits = splits < most ? splits : most;
        splits = splits < 1 ? 1 : splits > MAX_SPLITS ? MAX_SPLITS : splits;
    }
    const int64_t step = group * PARTIAL(head_dim); /* one split's partials */
    float *partials = NULL;
    if (splits > 1) {
        partials = malloc(sizeof(float) * (size_t)(pairs * splits * step));
        if (partials == NULL) return -2;
    }
    const int64_t chunk_max = (longest + splits - 1) / splits;
    /* a head's scores, padded to whole 8s: the scores pass writes a tile's tail as 8 */
    const int64_t stride = (chunk_max + 7) & ~(int64_t)7;
    const int64_t tasks = pairs * splits;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        /* scores [group][stride], then the V accumulators [group][head_dim] */
        float *scores = malloc(sizeof(float) * (size_t)(group * (stride + head_dim)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            const int64_t pair = task / splits, split = task % splits;
            const int64_t b = pair / num_kv_heads, kvh = pair % num_kv_heads;
            const int64_t chunk = (lens[b] + splits - 1) / splits;
            int64_t first = split * chunk, len = lens[b] - first;
            len = len < 0 ? 0 : len > chunk ? chunk : len;
            const Task k = {
                .keys = cache + kvh * stride_head,
                .stride_block = stride_block,
                .stride_token = stride_token,
                .stride_kv = stride_kv,
                .table = tables + b * table_stride,
                .first = first,
                .len = len,
                .block_size = block_size,
                .group = group,
                .head_dim = head_dim,
                .q = q + b * q_stride_b + kvh * group * q_stride_h,
                .q_stride_h = q_stride_h,
                .scale = scale,
            };
            run(&k, scores, stride, out + b * out_stride_b + kvh * group * out_stride_h,
                out_stride_h, partials == NULL ? NULL : partials + task * step);
        }
        free(scores);
        if (partials != NULL && !failed) {
            /* after the loop's barrier: every split is in */
#pragma omp for schedule(static)
            for (int64_t head = 0; head < pairs * group; head++) {
                const int64_t pair = head / group, g = head % group;
                const int64_t b = pair / num_kv_heads, kvh = pair % num_kv_heads;
                merge(partials + pair * splits * step + g * PARTIAL(head_dim), splits, step,
                      head_dim, out + b * out_stride_b + (kvh * group + g) * out_stride_h);
            }
        }
    }
    free(partials);
    return failed ? -2 : 0;
}
