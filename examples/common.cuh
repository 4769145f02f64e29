// Shared device helpers for the example kernels.
#pragma once

// Grid-stride loop bounds: every kernel here handles any n with any launch size.
#define GRID_STRIDE_LOOP(i, n)                                                  \
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n);                \
         i += blockDim.x * gridDim.x)

// Sum of `v` over the 32 lanes of a warp, returned in every lane.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}
