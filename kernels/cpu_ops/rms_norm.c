/* RMSNorm of float32 rows on CPU, optionally fused with the residual add: one pass per row where
 * torch runs eight ops. `kvasir.kernels.reference.norm` is the same arithmetic: the residual sum,
 * then x * (1 / sqrt(mean(x^2) + eps)), then the product with the weight; only the order of the
 * sum of squares differs (a few ulp). A decode step has one row per request, so this runs on the
 * calling thread.
 */
#include <math.h>
#include <stdint.h>

/* out[r] = weight * normalize(x[r] + residual[r]); summed[r] = x[r] + residual[r] when residual is
 * given (else x is normalised as it is and summed is not written). Rows are `*_stride` floats
 * apart; out and summed are contiguous [rows, dim]. */
void rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
              const float *weight, float *out, float *summed, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *sr = summed + r * dim;
        if (residual != 0) {
            const float *rr = residual + r * residual_stride;
            for (int64_t i = 0; i < dim; i++) sr[i] = xr[i] + rr[i];
            xr = sr;
        }
        /* Eight partial sums: vectorizable without reassociating a single running total. */
        float partial[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8)
            for (int j = 0; j < 8; j++) partial[j] += xr[i + j] * xr[i + j];
        float squares = 0.0f;
        for (; i < dim; i++) squares += xr[i] * xr[i];
        for (int j = 0; j < 8; j++) squares += partial[j];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t k = 0; k < dim; k++) o[k] = weight[k] * (xr[k] * inv);
    }
}
