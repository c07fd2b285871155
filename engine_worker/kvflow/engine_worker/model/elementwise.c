/* A decoder layer's elementwise passes over float32 or bf16 rows, one call each: RMSNorm
 * and RoPE.
 *
 * At a decode step's few rows each is a handful of microseconds of arithmetic, and torch
 * runs RMSNorm as five ops and RoPE as three, each paying its dispatch (about 10 us once the
 * layer's weights have flushed the caches). Compiled on first use (native_build.py) and
 * called from elementwise.py; single-threaded: the rows are few (the caller sends many rows
 * to torch's threaded ops). */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The sum of squares in 16 float lanes (what the compiler vectorizes), then added in double:
 * within an ulp of torch's vector_norm on the widths of real models. */
#define LANES 16

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for each of `rows` rows of n floats, rows
 * x_stride and out_stride floats apart. The product order is the reference's: (x * r) * w. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        float lanes[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int j = 0; j < LANES; j++) lanes[j] += xr[i + j] * xr[i + j];
        double sum = 0.0;
        for (int j = 0; j < LANES; j++) sum += lanes[j];
        for (; i < n; i++) sum += (double)xr[i] * xr[i];
        const float scale = (float)(1.0 / sqrt(sum / (double)n + (double)eps));
        for (i = 0; i < n; i++) o[i] = (xr[i] * scale) * w[i];
    }
}

/* Rotate, in place, `heads` vectors of head_dim floats per row (a row's vectors adjacent,
 * rows row_stride floats apart): dimension i with i + head_dim / 2, by the row's cos and
 * signed sin (rope.py's tables: -sin on the first half, +sin on the second), as the
 * reference's x * cos + rotate_half(x) * sin. */
void rope_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
              const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* bf16 rows: widened to float32, computed there, and rounded to bf16 (to nearest even) where
 * the reference rounds: its ops each return bf16. */
static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float round_bf16(float f) { /* f rounded to bf16's precision, as a float */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) <= 0x7F800000u) u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The reference's bf16 RMSNorm (llama.py RMSNorm's bf16 path): the mean of squares of the
 * widened row in float32 lanes, the normed row rounded to bf16, then times the bf16 weight,
 * rounded again. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out,
                   int64_t out_stride, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * out_stride;
        float lanes[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int j = 0; j < LANES; j++) {
                const float v = from_bf16(xr[i + j]);
                lanes[j] += v * v;
            }
        double sum = 0.0;
        for (int j = 0; j < LANES; j++) sum += lanes[j];
        for (; i < n; i++) sum += (double)from_bf16(xr[i]) * from_bf16(xr[i]);
        const float scale = (float)(1.0 / sqrt(sum / (double)n + (double)eps));
        for (i = 0; i < n; i++)
            o[i] = to_bf16(round_bf16(from_bf16(xr[i]) * scale) * from_bf16(w[i]));
    }
}

/* rope_f32 over bf16 rows and bf16 tables, with the reference's roundings: x * cos rounded,
 * then plus rotate_half(x) * sin (a product of two bf16, exact in float32), rounded. */
void rope_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
               const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + t * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = from_bf16(v[i]), b = from_bf16(v[i + half]);
                v[i] = to_bf16(round_bf16(a * from_bf16(c[i])) + b * from_bf16(s[i]));
                v[i + half] =
                    to_bf16(round_bf16(b * from_bf16(c[i + half])) + a * from_bf16(s[i + half]));
            }
        }
    }
}
