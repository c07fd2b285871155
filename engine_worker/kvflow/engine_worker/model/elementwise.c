/* A decoder layer's elementwise passes over float32 rows, one call each: RMSNorm, RoPE and
 * SwiGLU's activation.
 *
 * At a decode step's few rows each is a handful of microseconds of arithmetic, and torch
 * runs RMSNorm as five ops, RoPE as three and SiLU-and-multiply as two, each paying its
 * dispatch (about 10 us once the layer's weights have flushed the caches). Compiled on
 * first use (native_build.py) and called from elementwise.py; single-threaded: the rows are
 * few (the caller sends many rows to torch's threaded ops). */
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

/* e^x for x in [-87, 88] (clamped there: silu needs no more), in a form the compiler
 * vectorizes (no calls; the clamps become selects under -fno-trapping-math, which
 * native_build passes for this file): x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts,
 * Cody and Waite), e^r by Cephes' degree-6 polynomial, times 2^n built in the exponent
 * bits. Within a few ulp of expf (tests/engine/test_elementwise.py). */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    /* n = round(x / ln2): adding 1.5 * 2^23 leaves the integer part in the low bits. */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o,
                         int64_t width) {
    for (int64_t i = 0; i < width; i++) {
        const float x = g[i];
        o[i] = x / (1.0f + exp_f32(-x)) * u[i];
    }
}

/* out[r] = silu(gate) * up for each of `rows` rows of a fused projection [gate | up] (each
 * `width` floats, rows in_stride floats apart; out dense): SwiGLU's activation in one pass,
 * where torch runs a SiLU into a new tensor and a multiply. silu(g) = g / (1 + e^-g). */
void silu_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t rows,
                  int64_t width) {
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * in_stride, gate_up + r * in_stride + width, out + r * width,
                     width);
}
