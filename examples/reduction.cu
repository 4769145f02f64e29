// Sum of x[0..n) into *out: grid-stride partial sums, warp shuffles, one
// shared-memory slot per warp, one atomicAdd per block.
#include "common.cuh"

constexpr int kBlock = 256;

extern "C" __global__ void __launch_bounds__(kBlock)
reduce_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float warp_sums[kBlock / 32];
    float v = 0.0f;
    GRID_STRIDE_LOOP(i, n) { v += x[i]; }
    v = warp_sum(v);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < kBlock / 32 ? warp_sums[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) atomicAdd(out, v);
    }
}
