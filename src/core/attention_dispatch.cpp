#include <string>

#include "kernels/attention/api.h"
#include "kernels/attention/forward_sm90_heuristics.h"
#include "tpf/attention.h"
#include "tpf/error.h"

namespace tpf {

bool cuda_available() { return cuda::available(); }

void attention_forward(const AttentionForwardArgs& a, void* stream) {
  const AttentionDims d = check_attention_forward(a);
  if (a.q.device == Device::cpu) return attention_forward_cpu(a);
  TPF_CHECK(a.o.dtype == a.q.dtype, "o must have q's dtype");
  TPF_CHECK(a.lse.dtype == DType::f32, "lse must be float32 for CUDA tensors");
  const size_t need = attention_forward_workspace_bytes(d, Device::cuda);
  TPF_CHECK(a.workspace != nullptr && a.workspace_bytes >= need,
            "workspace must hold at least " + std::to_string(need) + " bytes, got " +
                std::to_string(a.workspace ? a.workspace_bytes : 0));
  cuda::attention_forward(a, d, stream);
}

void attention_backward(const AttentionBackwardArgs& a, void* stream) {
  const AttentionDims d = check_attention_backward(a);
  if (a.q.device == Device::cpu) return attention_backward_cpu(a);
  const size_t need = cuda::attention_backward_workspace_bytes(d);
  TPF_CHECK(a.workspace_bytes >= need, "workspace must hold at least " + std::to_string(need) +
                                           " bytes, got " + std::to_string(a.workspace_bytes));
  cuda::attention_backward(a, d, stream);
}

// Computed here, not in the CUDA library, from the kernels' header-only heuristics: a library
// built from another commit (the A/B runs swap them under one binding) keeps the same C API.
size_t attention_forward_workspace_bytes(const AttentionDims& d, Device device) {
  return device == Device::cpu ? 0 : cuda::fwd90::forward_workspace_bytes(d.B, d.H, d.Sq, d.Sk);
}

size_t attention_backward_workspace_bytes(const AttentionDims& d, Device device) {
  return device == Device::cpu ? 0 : cuda::attention_backward_workspace_bytes(d);
}

}  // namespace tpf
