/* blas_route.c: the BLAS that MLX's CPU backend loads under the wheel's bundled name
 * (libblas-*.so.3.10.0), built by build.rs in front of OpenBLAS.
 *
 * MLX's CPU matmul calls cblas_sgemm for every float32 product, also for a single row
 * (x[1, K] @ W^T: every decode-step projection). OpenBLAS 0.3.21's sgemm packs the whole weight
 * for such a call and reaches about 7 GB/s on this 2-core box; its sgemv reads the weight once
 * and reaches about 17-20 GB/s (BENCHMARKS.md). So products with one row or one column go to
 * cblas_sgemv here; every other call goes to OpenBLAS's own cblas_sgemm. All other BLAS symbols
 * (cblas_dgemm, cblas_cgemm, the Fortran names) come from OpenBLAS, which this library depends on.
 *
 * Semantics are BLAS's: C = alpha * op(A) op(B) + beta * C, and with beta == 0 C is not read.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

enum { ROW_MAJOR = 101 };
enum { NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
extern void cblas_sgemv(int order, int trans, int m, int n, float alpha, const float *a, int lda,
                        const float *x, int incx, float beta, float *y, int incy);

static sgemm_fn real_sgemm;
static uint64_t routed;

/* Products this library has sent to cblas_sgemv (read by mlx_sys::blas_routed_products). */
uint64_t mlx_models_blas_routed_products(void) { return __atomic_load_n(&routed, __ATOMIC_RELAXED); }

static sgemm_fn next_sgemm(void) {
    sgemm_fn f = __atomic_load_n(&real_sgemm, __ATOMIC_ACQUIRE);
    if (!f) {
        f = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
        if (!f) {
            void *h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_GLOBAL);
            if (h) f = (sgemm_fn)dlsym(h, "cblas_sgemm");
        }
        if (f) __atomic_store_n(&real_sgemm, f, __ATOMIC_RELEASE);
    }
    return f;
}

/* y[i * incy] = alpha * sum_k op(A)[i, k] x[k * incx] + beta * y[i * incy], i < rows, via sgemv. */
static void gemv_rows(int trans_a, int rows, int k, float alpha, const float *a, int lda, const float *x,
                      int incx, float beta, float *y, int incy) {
    if (beta == 0.0f)
        for (int i = 0; i < rows; i++) y[(size_t)i * incy] = 0.0f;
    if (trans_a == NO_TRANS)
        cblas_sgemv(ROW_MAJOR, NO_TRANS, rows, k, alpha, a, lda, x, incx, beta, y, incy);
    else
        cblas_sgemv(ROW_MAJOR, TRANS, k, rows, alpha, a, lda, x, incx, beta, y, incy);
}

/* Row-major C = alpha * op(A) op(B) + beta * C as one sgemv per row of C: cblas_sgemm's fallback
 * when no other sgemm can be found, exported so that a test can check it (mlx_sys's tests call it
 * through dlsym). Other orders are not used by MLX and leave C unchanged. */
void mlx_models_blas_sgemm_rows(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A,
                                int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (order != ROW_MAJOR || M <= 0 || N <= 0) return;
    for (int m = 0; m < M; m++) {
        const float *x = ta == NO_TRANS ? A + (size_t)m * lda : A + m;
        int incx = ta == NO_TRANS ? 1 : lda;
        if (K > 0) {
            gemv_rows(tb == TRANS ? NO_TRANS : TRANS, N, K, alpha, B, ldb, x, incx, beta, C + (size_t)m * ldc, 1);
        } else {
            for (int n = 0; n < N; n++) C[(size_t)m * ldc + n] = beta == 0.0f ? 0.0f : beta * C[(size_t)m * ldc + n];
        }
    }
}

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (order == ROW_MAJOR && M > 0 && N > 0 && K > 0 && (M == 1 || N == 1)) {
        __atomic_fetch_add(&routed, 1, __ATOMIC_RELAXED);
        if (M == 1) {
            /* C[0, n] = sum_k op(A)[0, k] op(B)[k, n]: op(B)^T is the matrix, op(A) the vector. */
            int incx = ta == NO_TRANS ? 1 : lda;
            gemv_rows(tb == TRANS ? NO_TRANS : TRANS, N, K, alpha, B, ldb, A, incx, beta, C, 1);
        } else {
            /* C[m, 0] = sum_k op(A)[m, k] op(B)[k, 0]. */
            int incx = tb == NO_TRANS ? ldb : 1;
            gemv_rows(ta, M, K, alpha, A, lda, B, incx, beta, C, ldc);
        }
        return;
    }
    sgemm_fn f = next_sgemm();
    if (f) {
        f(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    /* No sgemm found after this library (not expected: it links OpenBLAS). */
    mlx_models_blas_sgemm_rows(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
