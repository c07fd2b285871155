/* Decode attention on the CPU that reads K/V straight from the paged cache: one query token
 * per sequence over its own context, through its block table, in float32.
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
 * each pass vectorizes with no rescaling per token.
 *
 * The cache: [blocks, block_size, 2, num_kv_heads, head_dim], a token's K and V side by
 * side, strides in floats (paged_cache.py). Threads: OpenMP over tasks; the library links
 * libgomp.so.1 by soname like gemv_int4.c, so in torch's process it shares torch's runtime
 * (paged_decode.py runs it on one thread where it could not). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_AVX2 1
#endif

/* Query heads per KV head a call takes (Llama-3-70B: 8; paged_decode.py checks). */
#define MAX_GROUP 16

#ifdef PAGED_AVX2
static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
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
#endif

/* The rows of tokens t0..t0+n-1 (K's, or V's with the cache pointer past K) through the block
 * table: a tile's pointers, so the passes divide by the block size once per tile. */
#define TILE 32
static void tile_rows(const float *cache, int64_t stride_block, int64_t stride_token,
                      const int64_t *table, int64_t block_size, int64_t t0, int64_t n,
                      const float **rows) {
    int64_t block = t0 / block_size, offset = t0 % block_size;
    const float *row = cache + table[block] * stride_block + offset * stride_token;
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

/* scores[g][t] = q_g . k_t * scale for the task's tokens; the max of each head's in maxes. */
static void scores_pass(const float *qb, int64_t q_stride_h, const float *cache,
                        int64_t stride_block, int64_t stride_token, const int64_t *table,
                        int64_t len, int64_t block_size, int64_t group, int64_t head_dim,
                        float scale, float *scores, int64_t longest, float *maxes) {
    const float *rows[TILE];
    for (int64_t g = 0; g < group; g++) maxes[g] = -INFINITY;
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        tile_rows(cache, stride_block, stride_token, table, block_size, t0, n, rows);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qb + g * q_stride_h;
            float *s = scores + g * longest + t0;
            int64_t j = 0;
#ifdef PAGED_AVX2
            if (head_dim % 8 == 0) {
                /* 8 tokens at once: 8 running products, summed across by a tree of hadds
                 * into one vector of their 8 scores */
                __m256 top = _mm256_set1_ps(maxes[g]);
                for (; j + 8 <= n; j += 8) {
                    __m256 a[8];
                    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                    for (int64_t i = 0; i < head_dim; i += 8) {
                        const __m256 x = _mm256_loadu_ps(qg + i);
                        for (int r = 0; r < 8; r++)
                            a[r] = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[j + r] + i), a[r]);
                    }
                    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                                     _mm256_hadd_ps(a[2], a[3]));
                    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]),
                                                     _mm256_hadd_ps(a[6], a[7]));
                    const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                      _mm256_permute2f128_ps(u0, u1, 0x31));
                    const __m256 scaled = _mm256_mul_ps(dots, _mm256_set1_ps(scale));
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
                for (int64_t i = 0; i < head_dim; i++) dot += qg[i] * rows[j][i];
                s[j] = dot * scale;
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
static void values_pass(const float *scores, int64_t longest, const float *cache,
                        int64_t stride_block, int64_t stride_token, const int64_t *table,
                        int64_t len, int64_t block_size, int64_t group, int64_t head_dim,
                        float *acc) {
    const float *rows[TILE];
    for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        tile_rows(cache, stride_block, stride_token, table, block_size, t0, n, rows);
        for (int64_t g = 0; g < group; g++) {
            const float *p = scores + g * longest + t0;
            float *a = acc + g * head_dim;
            int64_t i = 0;
#ifdef PAGED_AVX2
            for (; i + 32 <= head_dim; i += 32) {
                __m256 a0 = _mm256_loadu_ps(a + i), a1 = _mm256_loadu_ps(a + i + 8);
                __m256 a2 = _mm256_loadu_ps(a + i + 16), a3 = _mm256_loadu_ps(a + i + 24);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 pj = _mm256_set1_ps(p[j]);
                    const float *v = rows[j] + i;
                    a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), a0);
                    a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), a1);
                    a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), a2);
                    a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), a3);
                }
                _mm256_storeu_ps(a + i, a0);
                _mm256_storeu_ps(a + i + 8, a1);
                _mm256_storeu_ps(a + i + 16, a2);
                _mm256_storeu_ps(a + i + 24, a3);
            }
#endif
            for (; i < head_dim; i++) {
                float sum = a[i];
                for (int64_t j = 0; j < n; j++) sum += p[j] * rows[j][i];
                a[i] = sum;
            }
        }
    }
}

/* out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b for each sequence b of `batch`, K_b and V_b
 * its first lens[b] tokens through tables[b]. Returns 0, -1 for a group over MAX_GROUP,
 * -2 when the score buffer cannot be allocated. */
int paged_decode_f32(const float *q, int64_t q_stride_b, int64_t q_stride_h, const float *cache,
                     int64_t stride_block, int64_t stride_token, int64_t stride_kv,
                     int64_t stride_head, const int64_t *tables, int64_t table_stride,
                     const int64_t *lens, float *out, int64_t out_stride_b, int64_t out_stride_h,
                     int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, float scale, int32_t threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (group < 1 || group > MAX_GROUP) return -1;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++)
        if (lens[b] > longest) longest = lens[b];
    const int64_t tasks = batch * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        /* scores [group][longest], then the V accumulators [group][head_dim] */
        float *scores = malloc(sizeof(float) * (size_t)(group * (longest + head_dim)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
            const int64_t len = lens[b];
            const int64_t *table = tables + b * table_stride;
            const float *qb = q + b * q_stride_b + kvh * group * q_stride_h;
            const float *keys = cache + kvh * stride_head, *values = keys + stride_kv;
            float *acc = scores + group * longest;
            float maxes[MAX_GROUP], sums[MAX_GROUP];
            scores_pass(qb, q_stride_h, keys, stride_block, stride_token, table, len,
                        block_size, group, head_dim, scale, scores, longest, maxes);
            exp_pass(scores, longest, len, group, maxes, sums);
            values_pass(scores, longest, values, stride_block, stride_token, table, len,
                        block_size, group, head_dim, acc);
            for (int64_t g = 0; g < group; g++) {
                float *o = out + b * out_stride_b + (kvh * group + g) * out_stride_h;
                const float inv = 1.0f / sums[g];
                for (int64_t i = 0; i < head_dim; i++) o[i] = acc[g * head_dim + i] * inv;
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
