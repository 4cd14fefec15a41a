// Kernels of the CUDA transport: batched strided box copies (pack into a staging area,
// unpack from it, local copies between buffers of one GPU). One launch carries up to
// kCopyTasksPerLaunch tasks by value; blocks are dealt to tasks by their unit counts.
// No schedule, NCCL or XLA knowledge here (pack.h is the whole interface).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "xla_ffi/cuda/pack.h"

namespace jax_m2n {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // units in flight per thread (loads issued before stores)
constexpr uint64_t kUnitsPerBlock = uint64_t{kThreads} * kUnroll;

struct CopyBatch {
  int32_t n;
  uint32_t block_start[kCopyTasksPerLaunch + 1];  // prefix sums of blocks per task
  CopyTask tasks[kCopyTasksPerLaunch];
};
static_assert(sizeof(CopyBatch) <= 32000, "kernel parameter over the CUDA limit");

// 32-bit division when both fit: 64-bit division is a long software sequence.
__device__ __forceinline__ uint64_t DivMod(uint64_t a, uint64_t b, uint64_t* rem) {
  if (((a | b) >> 32) == 0) {
    uint32_t q = static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    *rem = static_cast<uint32_t>(a) - q * static_cast<uint32_t>(b);
    return q;
  }
  uint64_t q = a / b;
  *rem = a - q * b;
  return q;
}

__device__ __forceinline__ void RowOffsets(const CopyTask& t, uint64_t row,
                                           int64_t* src_off, int64_t* dst_off) {
  if (t.n_outer == 1) {  // the common 2-D case: no division
    *src_off = static_cast<int64_t>(row) * t.src_stride[0];
    *dst_off = static_cast<int64_t>(row) * t.dst_stride[0];
    return;
  }
  int64_t s = 0, d = 0;
  for (int k = 0; k < t.n_outer; ++k) {
    uint64_t i;
    row = DivMod(row, t.extent[k], &i);
    s += static_cast<int64_t>(i) * t.src_stride[k];
    d += static_cast<int64_t>(i) * t.dst_stride[k];
  }
  *src_off = s;
  *dst_off = d;
}

template <typename V>
__device__ __forceinline__ void CopyUnits(const CopyTask& t, uint64_t first) {
  const uint64_t total = t.rows * t.row_units;
  V v[kUnroll];
  int64_t dst_at[kUnroll];
  bool live[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const uint64_t u = first + static_cast<uint64_t>(k) * kThreads + threadIdx.x;
    live[k] = u < total;
    if (live[k]) {
      uint64_t col;
      const uint64_t row = DivMod(u, t.row_units, &col);
      int64_t s, d;
      RowOffsets(t, row, &s, &d);
      const int64_t c = static_cast<int64_t>(col) * static_cast<int64_t>(sizeof(V));
      v[k] = *reinterpret_cast<const V*>(t.src + s + c);
      dst_at[k] = d + c;
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (live[k]) *reinterpret_cast<V*>(t.dst + dst_at[k]) = v[k];
  }
}

__global__ void __launch_bounds__(kThreads)
    CopyBoxesKernel(const __grid_constant__ CopyBatch batch) {
  // The task owning this block: last i with block_start[i] <= blockIdx.x.
  const uint32_t b = blockIdx.x;
  int lo = 0, hi = batch.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.block_start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const CopyTask& t = batch.tasks[lo];
  const uint64_t first = static_cast<uint64_t>(b - batch.block_start[lo]) * kUnitsPerBlock;
  switch (t.vec_log2) {
    case 4: CopyUnits<uint4>(t, first); break;
    case 3: CopyUnits<uint2>(t, first); break;
    case 2: CopyUnits<uint32_t>(t, first); break;
    case 1: CopyUnits<uint16_t>(t, first); break;
    default: CopyUnits<uint8_t>(t, first); break;
  }
}

}  // namespace

cudaError_t LaunchCopyTasks(const CopyTask* tasks, int n, cudaStream_t stream) {
  int i = 0;
  while (i < n) {
    // Held in host memory only for the launch: parameters are copied at launch.
    CopyBatch batch;
    batch.n = 0;
    uint64_t blocks = 0;
    for (; i < n && batch.n < kCopyTasksPerLaunch; ++i) {
      const CopyTask& t = tasks[i];
      const uint64_t units = t.rows * t.row_units;
      if (units == 0) continue;
      const uint64_t need = (units + kUnitsPerBlock - 1) / kUnitsPerBlock;
      if (need > 0x7fffffffu) return cudaErrorInvalidValue;  // > 2^41 units
      if (batch.n > 0 && blocks + need > 0x7fffffffu) break;  // next launch
      batch.block_start[batch.n] = static_cast<uint32_t>(blocks);
      batch.tasks[batch.n] = t;
      ++batch.n;
      blocks += need;
    }
    if (batch.n == 0) continue;
    batch.block_start[batch.n] = static_cast<uint32_t>(blocks);
    CopyBoxesKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(batch);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t PreloadCopyKernel() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, CopyBoxesKernel);
}

}  // namespace jax_m2n
