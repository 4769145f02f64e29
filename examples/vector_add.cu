// c = a + b, elementwise.
#include "common.cuh"

extern "C" __global__ void vector_add(const float* __restrict__ a,
                                      const float* __restrict__ b,
                                      float* __restrict__ c, int n) {
    GRID_STRIDE_LOOP(i, n) { c[i] = a[i] + b[i]; }
}
