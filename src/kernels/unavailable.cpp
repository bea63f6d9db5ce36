// Linked into builds without the CUDA library: every CUDA entry point says so.
#include "kernels/attention/api.h"
#include "kernels/glue/api.h"
#include "kernels/info.h"
#include "kernels/trimul/api.h"
#include "tpf/error.h"

namespace tpf::cuda {

namespace {
[[noreturn]] void unavailable() {
  throw Error(
      "this build of tpfkit has no CUDA kernels; use CPU tensors or rebuild "
      "with nvcc available (TPF_CUDA=ON)");
}
}  // namespace

bool available() { return false; }
CudaInfo info() { return {}; }
void attention_forward(const AttentionForwardArgs&, const AttentionDims&, void*) { unavailable(); }
void attention_backward(const AttentionBackwardArgs&, const AttentionDims&, void*) {
  unavailable();
}
void trimul_forward(const TrimulForwardArgs&, const TrimulDims&, void*) { unavailable(); }
void trimul_backward(const TrimulBackwardArgs&, const TrimulDims&, void*) { unavailable(); }
void layer_norm_forward(const LayerNormForwardArgs&, const glue::Rows&, int64_t, void*) {
  unavailable();
}
void layer_norm_backward(const LayerNormBackwardArgs&, const glue::Rows&, int64_t, void*) {
  unavailable();
}
void swiglu_forward(const SwigluArgs&, void*) { unavailable(); }
void swiglu_backward(const SwigluArgs&, void*) { unavailable(); }
void gated_output_forward(const GatedOutputArgs&, const glue::Heads&, void*) { unavailable(); }
void gated_output_backward(const GatedOutputArgs&, const glue::Heads&, void*) { unavailable(); }

}  // namespace tpf::cuda
