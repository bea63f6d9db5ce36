// Conversions between the kernels' storage types (float, __half, __nv_bfloat16) and float, the
// one set every kernel family uses: to_float(x), from_float<T>(v) (round to nearest even).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tpf::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float(float x) {
  return x;
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ float from_float(float x) {
  return x;
}

}  // namespace tpf::cuda
