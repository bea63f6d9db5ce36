// TMA for the attention kernels' [B, N, H, S, D] tensors (q, k, v, dO), shared by the forward and
// the backward: the host describes a tensor as a 5-d map whose box is `box_rows` rows of `box_d`
// features; a producer thread copies a box into shared memory, completing on an mbarrier.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include <cute/arch/copy_sm90_tma.hpp>

#include "kernels/attention/params.h"
#include "tpf/error.h"

namespace tpf::cuda {

// ---- host --------------------------------------------------------------------------------------------

// A driver function as of CUDA 12.0 (the runtime finds it; no link against libcuda).
inline void* driver_entry_point(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q);
  TPF_CHECK(
      e == cudaSuccess && q == cudaDriverEntryPointSuccess && f != nullptr,
      std::string("the CUDA driver has no ") + name + " (a driver for CUDA 12 or newer is needed)");
  return f;
}

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(
      driver_entry_point("cuTensorMapEncodeTiled"));
  return fn;
}

// The encoder is a driver call and needs a current context, which a thread that has made no
// runtime call yet lacks: autograd's backward thread on its first call in a process (the encoder
// answered CUDA_ERROR_INVALID_CONTEXT, 201, and the op failed; 2026-12-07). Where the thread has
// none, the runtime's current device's primary context is made current (cudaSetDevice does that
// since CUDA 12). Never during a stream capture: a capturing thread has its context current, and
// cudaFree(nullptr), the usual way, would end the capture.
inline void make_context_current() {
  static const auto get =
      reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(driver_entry_point("cuCtxGetCurrent"));
  CUcontext ctx = nullptr;
  if (get(&ctx) == CUDA_SUCCESS && ctx != nullptr) return;
  int device = 0;
  TPF_CHECK(cudaGetDevice(&device) == cudaSuccess && cudaSetDevice(device) == cudaSuccess,
            "could not make the CUDA device's context current on this thread");
}

// A 16-bit tensor as a TMA map of rank 1 + `outer`: dim 0 the contiguous one (`inner` elements,
// read as zero past them), then the `outer` others (size, stride in elements, box) sorted by
// stride (the layout TMA's documentation describes, whatever the view); dims gets the position of
// outer dim j in bits 2j..2j+1 (tma_load_rows / tma_load_bias's argument).
inline CUtensorMap tiled_tensor_map(const void* data, bool fp16, int outer, const int64_t* size,
                                    const int64_t* stride, const uint32_t* box, int64_t inner,
                                    uint32_t box_inner, CUtensorMapSwizzle swizzle,
                                    const char* name, uint32_t& dims) {
  struct Dim {
    int64_t size, stride;
    uint32_t box;
    int which;
  };
  Dim d[4];
  for (int j = 0; j < outer; ++j) d[j] = {size[j], stride[j], box[j], j};
  std::stable_sort(d, d + outer, [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  cuuint64_t sizes[5] = {cuuint64_t(inner)};
  cuuint64_t strides[4];
  cuuint32_t boxes[5] = {box_inner};
  dims = 0;
  for (int i = 0; i < outer; ++i) {
    sizes[1 + i] = cuuint64_t(d[i].size);
    strides[i] = cuuint64_t(d[i].stride) * 2;
    boxes[1 + i] = d[i].box;
    dims |= uint32_t(i) << (2 * d[i].which);
  }
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  make_context_current();
  CUtensorMap map;
  const CUresult r = tensor_map_encoder()(
      &map, fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      cuuint32_t(1 + outer), const_cast<void*>(data), sizes, strides, boxes, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TPF_CHECK(r == CUDA_SUCCESS,
            std::string("could not describe ") + name + " for TMA (cuTensorMapEncodeTiled error " +
                std::to_string(int(r)) + ")" +
                (r == CUDA_ERROR_INVALID_VALUE
                     ? ": its start and every stride but the last must be multiples of 16 bytes"
                     : ""));
  return map;
}

// A 16-bit [B, N, H, S, D] tensor (`st`: its strides in elements, the feature stride 1) with a box
// of `box_rows` rows x `box_d` features (rows and features past the tensor read as zero); outer
// dims row, h, n, b.
inline CUtensorMap rows_tensor_map(const void* data, const Strides4& st, int B, int N, int H, int S,
                                   int D, bool fp16, uint32_t box_d, uint32_t box_rows,
                                   CUtensorMapSwizzle swizzle, const char* name, uint32_t& dims) {
  const int64_t size[4] = {S, H, N, B}, stride[4] = {st.s, st.h, st.n, st.b};
  const uint32_t box[4] = {box_rows, 1, 1, 1};
  return tiled_tensor_map(data, fp16, 4, size, stride, box, D, box_d, swizzle, name, dims);
}

// ---- device ------------------------------------------------------------------------------------------

__device__ __forceinline__ void tma_load_5d(const CUtensorMap* map, uint64_t* bar, void* dst,
                                            int c0, int c1, int c2, int c3, int c4) {
  // The evict-normal policy value CuTe uses: no L2 hint beyond the default.
  constexpr uint64_t kCacheHintNormal = 0x1000000000000000ull;
  cute::SM90_TMA_LOAD_5D::copy(map, bar, kCacheHintNormal, dst, c0, c1, c2, c3, c4);
}

// The box of rows_tensor_map's `map` at feature d0, row row0 of slice (b, n, h), into `dst`.
__device__ __forceinline__ void tma_load_rows(const CUtensorMap* map, uint32_t dims, uint64_t* bar,
                                              void* dst, int d0, int row0, int h, int n, int b) {
  const int order[4] = {row0, h, n, b};
  int c[5] = {d0, 0, 0, 0, 0};
#pragma unroll
  for (int which = 0; which < 4; ++which) {
    const int dim = (dims >> (2 * which)) & 3;  // 0..3: map dim 1..4
#pragma unroll
    for (int i = 0; i < 4; ++i) c[1 + i] = dim == i ? order[which] : c[1 + i];
  }
  tma_load_5d(map, bar, dst, c[0], c[1], c[2], c[3], c[4]);
}

// The box of a 4-d map (tiled_tensor_map, outer dims row, h, b) at column c0, row row0 of (b, h).
__device__ __forceinline__ void tma_load_bias(const CUtensorMap* map, uint32_t dims, uint64_t* bar,
                                              void* dst, int c0, int row0, int h, int b) {
  const int order[3] = {row0, h, b};
  int c[4] = {c0, 0, 0, 0};
#pragma unroll
  for (int which = 0; which < 3; ++which) {
    const int dim = (dims >> (2 * which)) & 3;
#pragma unroll
    for (int i = 0; i < 3; ++i) c[1 + i] = dim == i ? order[which] : c[1 + i];
  }
  constexpr uint64_t kCacheHintNormal = 0x1000000000000000ull;
  cute::SM90_TMA_LOAD_4D::copy(map, bar, kCacheHintNormal, dst, c[0], c[1], c[2], c[3]);
}

// `bytes` (a multiple of 16, both ends on 16 bytes) from global to shared memory, completing on bar.
__device__ __forceinline__ void bulk_copy(const void* src, uint64_t* bar, void* dst, int bytes) {
  cute::SM90_BULK_COPY_G2S::copy(src, bar, dst, bytes);
}

}  // namespace tpf::cuda
