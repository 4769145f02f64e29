// y = alpha * x + y (BLAS level 1), in float and double.
#include "common.cuh"

template <typename T>
__device__ void saxpy_impl(T alpha, const T* __restrict__ x, T* __restrict__ y, int n) {
    GRID_STRIDE_LOOP(i, n) { y[i] = alpha * x[i] + y[i]; }
}

extern "C" __global__ void saxpy(float alpha, const float* x, float* y, int n) {
    saxpy_impl(alpha, x, y, n);
}

extern "C" __global__ void daxpy(double alpha, const double* x, double* y, int n) {
    saxpy_impl(alpha, x, y, n);
}
