// Kernels of the CUDA transport and the local data plane: batched strided box copies (pack
// into a staging area, unpack from it, local copies, stores into / loads from a peer GPU's
// memory or another program's exported memory through a device-side pointer table), plain or
// converting the element type (xla_ffi/convert.h). One launch carries up to
// kCopyTasksPerLaunch tasks of one kind by value; blocks are dealt to tasks by their unit
// counts. No schedule, NCCL or XLA knowledge here (pack.h is the whole interface).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "xla_ffi/convert.h"
#include "xla_ffi/cuda/convert_cuda.h"
#include "xla_ffi/cuda/pack.h"

namespace jax_m2n {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // units in flight per thread (loads issued before stores)
constexpr uint64_t kUnitsPerBlock = uint64_t{kThreads} * kUnroll;

struct CopyBatch {
  int32_t n;
  const int64_t* table;  // device memory: the tasks' src_slot / dst_slot addresses
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

// The task's source and destination addresses: table entries plus offsets for slots.
__device__ __forceinline__ void Addresses(const CopyBatch& batch, const CopyTask& t,
                                          const char** src, char** dst) {
  *src = t.src_slot < 0 ? t.src
                        : reinterpret_cast<const char*>(batch.table[t.src_slot]) +
                              reinterpret_cast<uintptr_t>(t.src);
  *dst = t.dst_slot < 0 ? t.dst
                        : reinterpret_cast<char*>(batch.table[t.dst_slot]) +
                              reinterpret_cast<uintptr_t>(t.dst);
}

// Unit `u` of a task: its column (in units) within its row, returned, and the byte
// offsets of that row in the source and the destination.
__device__ __forceinline__ int64_t UnitAt(const CopyTask& t, uint64_t u, int64_t* src_off,
                                          int64_t* dst_off) {
  uint64_t col;
  RowOffsets(t, DivMod(u, t.row_units, &col), src_off, dst_off);
  return static_cast<int64_t>(col);
}

template <typename V>
__device__ __forceinline__ void CopyUnits(const CopyTask& t, const char* src, char* dst,
                                          uint64_t first) {
  const uint64_t total = t.rows * t.row_units;
  V v[kUnroll];
  int64_t dst_at[kUnroll];
  bool live[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const uint64_t u = first + static_cast<uint64_t>(k) * kThreads + threadIdx.x;
    live[k] = u < total;
    if (live[k]) {
      int64_t s, d;
      const int64_t c = UnitAt(t, u, &s, &d) * static_cast<int64_t>(sizeof(V));
      v[k] = *reinterpret_cast<const V*>(src + s + c);
      dst_at[k] = d + c;
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (live[k]) *reinterpret_cast<V*>(dst + dst_at[k]) = v[k];
  }
}

// The task owning this block (the last i with block_start[i] <= blockIdx.x) and, in
// `*first`, the first of its units this block copies.
__device__ __forceinline__ const CopyTask& BlockTask(const CopyBatch& batch,
                                                     uint64_t* first) {
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
  *first = static_cast<uint64_t>(b - batch.block_start[lo]) * kUnitsPerBlock;
  return batch.tasks[lo];
}

__global__ void __launch_bounds__(kThreads)
    CopyBoxesKernel(const __grid_constant__ CopyBatch batch) {
  uint64_t first;
  const CopyTask& t = BlockTask(batch, &first);
  const char* src;
  char* dst;
  Addresses(batch, t, &src, &dst);
  switch (t.vec_log2) {
    case 4: CopyUnits<uint4>(t, src, dst, first); break;
    case 3: CopyUnits<uint2>(t, src, dst, first); break;
    case 2: CopyUnits<uint32_t>(t, src, dst, first); break;
    case 1: CopyUnits<uint16_t>(t, src, dst, first); break;
    default: CopyUnits<uint8_t>(t, src, dst, first); break;
  }
}

// --- converting copies ------------------------------------------------------------

// N elements loaded or stored together (one instruction up to 16 bytes, two for 32).
template <typename S, int N>
struct alignas(sizeof(S) * N) Vec {
  S v[N];
};

template <ElemType kFrom, ElemType kTo, int N>
__device__ __forceinline__ void ConvertUnits(const CopyTask& t, const char* src, char* dst,
                                             uint64_t first) {
  using SF = ElemBits<kFrom>;
  using ST = ElemBits<kTo>;
  // Units in flight per pass: all kUnroll, or half of them for 8-element units (registers).
  constexpr int kBatch = N >= 8 ? kUnroll / 2 : kUnroll;
  const uint64_t total = t.rows * t.row_units;
#pragma unroll
  for (int pass = 0; pass < kUnroll; pass += kBatch) {
    Vec<SF, N> v[kBatch];
    int64_t dst_at[kBatch];
    bool live[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const uint64_t u = first + static_cast<uint64_t>(pass + k) * kThreads + threadIdx.x;
      live[k] = u < total;
      if (live[k]) {
        int64_t s, d;
        const int64_t c = UnitAt(t, u, &s, &d);
        v[k] = *reinterpret_cast<const Vec<SF, N>*>(src + s + c * sizeof(Vec<SF, N>));
        dst_at[k] = d + c * static_cast<int64_t>(sizeof(Vec<ST, N>));
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (!live[k]) continue;
      Vec<ST, N> out;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        out.v[i] = convert_cuda::ConvertElementXlaGpu<kFrom, kTo>(v[k].v[i]);
      }
      *reinterpret_cast<Vec<ST, N>*>(dst + dst_at[k]) = out;
    }
  }
}

// One kernel per pair: ptxas takes minutes on one kernel holding all 20. Conversions as
// XLA GPU does them (convert_cuda.h), which is what `astype` gives on the same GPU.
template <ElemType kFrom, ElemType kTo>
__global__ void __launch_bounds__(kThreads)
    ConvertBoxesKernel(const __grid_constant__ CopyBatch batch) {
  uint64_t first;
  const CopyTask& t = BlockTask(batch, &first);
  const char* src;
  char* dst;
  Addresses(batch, t, &src, &dst);
  switch (t.vec_log2) {
    case 3: ConvertUnits<kFrom, kTo, 8>(t, src, dst, first); break;
    case 2: ConvertUnits<kFrom, kTo, 4>(t, src, dst, first); break;
    case 1: ConvertUnits<kFrom, kTo, 2>(t, src, dst, first); break;
    default: ConvertUnits<kFrom, kTo, 1>(t, src, dst, first); break;
  }
}

using BatchKernel = void (*)(CopyBatch);

template <ElemType kFrom>
BatchKernel ConvertKernelTo(int to) {
  switch (to) {
    case 1: return ConvertBoxesKernel<kFrom, ElemType::kF32>;
    case 2: return ConvertBoxesKernel<kFrom, ElemType::kF16>;
    case 3: return ConvertBoxesKernel<kFrom, ElemType::kBF16>;
    case 4: return ConvertBoxesKernel<kFrom, ElemType::kF8E4M3FN>;
    case 5: return ConvertBoxesKernel<kFrom, ElemType::kF8E5M2>;
    default: return nullptr;
  }
}

// The kernel of a task: the plain copy, or the converting one of its pair (null: an
// unsupported pair or unit).
BatchKernel KernelOf(const CopyTask& t) {
  if (t.src_type == t.dst_type) return CopyBoxesKernel;
  if (t.vec_log2 < 0 || t.vec_log2 > kConvertMaxVecLog2) return nullptr;
  switch (t.src_type) {
    case 1: return ConvertKernelTo<ElemType::kF32>(t.dst_type);
    case 2: return ConvertKernelTo<ElemType::kF16>(t.dst_type);
    case 3: return ConvertKernelTo<ElemType::kBF16>(t.dst_type);
    case 4: return ConvertKernelTo<ElemType::kF8E4M3FN>(t.dst_type);
    case 5: return ConvertKernelTo<ElemType::kF8E5M2>(t.dst_type);
    default: return nullptr;
  }
}

// Launches the tasks among `tasks` whose kernel is `kernel`, in as few launches as fit.
cudaError_t LaunchKernel(BatchKernel kernel, const CopyTask* tasks, int n,
                         cudaStream_t stream, const int64_t* table) {
  int i = 0;
  while (i < n) {
    // Held in host memory only for the launch: parameters are copied at launch.
    CopyBatch batch;
    batch.n = 0;
    batch.table = table;
    uint64_t blocks = 0;
    for (; i < n && batch.n < kCopyTasksPerLaunch; ++i) {
      const CopyTask& t = tasks[i];
      if (KernelOf(t) != kernel) continue;
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
    cudaGetLastError();  // an earlier call's error on this thread is not this launch's
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(batch);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchCopyTasks(const CopyTask* tasks, int n, cudaStream_t stream,
                            const int64_t* table) {
  // One launch series per kernel (plain copies, then each converting pair present).
  BatchKernel done[kCopyTasksPerLaunch];
  int n_done = 0;
  for (int i = 0; i < n; ++i) {
    BatchKernel kernel = KernelOf(tasks[i]);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    if (table == nullptr && (tasks[i].src_slot >= 0 || tasks[i].dst_slot >= 0)) {
      return cudaErrorInvalidValue;
    }
    if (std::find(done, done + n_done, kernel) != done + n_done) continue;
    if (cudaError_t err = LaunchKernel(kernel, tasks, n, stream, table); err != cudaSuccess) {
      return err;
    }
    if (n_done < kCopyTasksPerLaunch) done[n_done++] = kernel;
  }
  return cudaSuccess;
}

cudaError_t PreloadCopyKernels() {
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, CopyBoxesKernel);
  for (int from = 1; from <= 5 && err == cudaSuccess; ++from) {
    for (int to = 1; to <= 5 && err == cudaSuccess; ++to) {
      CopyTask t = {};
      t.src_type = from;
      t.dst_type = to;
      if (from != to) err = cudaFuncGetAttributes(&attributes, KernelOf(t));
    }
  }
  return err;
}

}  // namespace jax_m2n
