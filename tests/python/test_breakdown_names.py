"""The breakdown's classification table (tpfkit.benchmarks.breakdown.CLASSES, issue 30) against
real kernel names, as the PyTorch profiler reports them on CUDA (demangled): a short,
representative list taken from the libraries the clients' steps run, each with the class it
must land in (long argument lists abbreviated with "..." where the class does not depend on
them). Our own kernels are checked against src/kernels in test_clients_breakdown.py.

Where the names come from (to list them again for a new release):

- cuEquivariance (the cuequivariance_ops_cu13 / cuequivariance_ops_torch_cu13 0.13.0 wheels,
  .whl/cueq.tar.xz): `cuobjdump -symbols` on cuequivariance_ops/lib/libcue_ops.so and on
  cuequivariance_ops_torch/_ext/*.so, entries (STO_ENTRY) through c++filt. Triangle attention
  runs its own cuDNN-derived FMHA (on sm_80 to sm_90: cudnn_fmha::fwd::fp16::
  cudnn_sm80_fprop_sdpa_fp16_64x64xD forward; compute_dot_do_o, cudnn_sm80_bprop_fmha_fp16_64x64xD,
  convert_dq backward); the sm90 trimul kernels of the extension are cueq::kf_zhifan_sm90::...
  Its trimul also launches prebuilt CuTe DSL cubins that cuobjdump does not list: their
  symbols (kernel_cutlass_<function>_..., at most 189 characters) are in `strings` of the
  extension and in cuequivariance_ops_torch/cubin_manifests/*.json ("kernel_symbol"), one of
  them a hashed kf<hex>___... Its Triton kernels are the @triton.jit functions of
  cuequivariance_ops/triton/*.py and cuequivariance_ops_torch/*.py.
- PyTorch 2.11 (cu130): `cuobjdump -symbols -arch sm_90` on torch/lib/libtorch_cuda.so.
- cuBLAS(Lt) 13: `cuobjdump -symbols -arch sm_90[a]` on nvidia/cu13/lib/libcublas*.so; its nvjet
  kernels are not listed there (stored compressed), the name below is as H100 traces show them.
- TriFast 0.1.13 (trifast/triton.py): its four @triton.jit kernels.
"""
from __future__ import annotations

import pytest

from tpfkit.benchmarks import breakdown

FMHA_STRIDES = ", ".join(["cudnn_fmha::strides_t"] * 7)

CUEQUIVARIANCE = [
    # Triangle attention, sm_80 .. sm_90 (H100, H200): forward, backward.
    "void cudnn_fmha::fwd::fp16::cudnn_sm80_fprop_sdpa_fp16_64x64xD<false, 32>(cudnn_fmha::"
    f"AttentionDescriptor, {FMHA_STRIDES}, float*, float*, float, float*, float*, float*, float*, "
    "float*, bool*, int, int)",
    "void cudnn_fmha::bwd::fp16::compute_dot_do_o<false>(cudnn_fmha::AttentionDescriptor, float*, "
    "void*, float*, cudnn_fmha::strides_t, cudnn_fmha::strides_t)",
    "void cudnn_fmha::bwd::fp16::cudnn_sm80_bprop_fmha_fp16_64x64xD<true, 32>(cudnn_fmha::"
    "AttentionDescriptor, cudnn_fmha::strides_t, cudnn_fmha::strides_t, cudnn_fmha::strides_t, "
    "cudnn_fmha::strides_t, cudnn_fmha::strides_t, cudnn_fmha::strides_t, cudnn_fmha::strides_t, "
    "cudnn_fmha::strides_t, cudnn_fmha::strides_t, void*, void*, float, float*, void*, void*, "
    "void*, float*, void*, void*, int, int, cudnn_fmha::strides_t, cudnn_fmha::strides_t, float*, "
    "float*, bool*)",
    "void cudnn_fmha::bwd::fp16::convert_dq<false>(cudnn_fmha::AttentionDescriptor, float*, void*, "
    "cudnn_fmha::strides_t)",
    # ... its fp32 (TF32) kernels are extern "C", unqualified
    "native_sm80_fprop_fmha_tf32_64x32x32",
    "native_sm80_fprop_fmha_fp32_ffma_64x32x32",
    "cudnn_sm80_bprop_fmha_tf32_64x64x32",
    "compute_dot_do_o",
    # ... and on sm_100 / sm_120
    "void cudnn_sm100_fprop_sdpa_128x128xD<(cudnn_fmha::qkv_type_t)0, false, 128, 128, 3>("
    "cudnn_fmha::AttentionDescriptorWithHeadsPerK, tma::cudaTmaDesc, tma::cudaTmaDesc, "
    "tma::cudaTmaDesc, tma::cudaTmaDesc, tma::cudaTmaDesc, cudnn_fmha::strides_t, "
    "cudnn_fmha::strides_t, float, float*, float*, char const*, int const*)",
    "void convert_dBias<(cudnn_fmha::qkv_type_t)0>(cudnn_fmha::AttentionDescriptorWithHeadsPerK, "
    "float const*, unsigned short*, cudnn_fmha::strides_t, cudnn_fmha::strides_t, float)",
    "cudnn_fmha::(anonymous namespace)::zero_invalid_triangle_attention_rows(unsigned short*, "
    "float*, float*, int const*, unsigned int, unsigned int, unsigned int, unsigned int, long, "
    "long, long, long, unsigned long, long, long)",
    # ... mangled, should the profiler not demangle it
    "_ZN10cudnn_fmha3fwd4fp1634cudnn_sm80_fprop_sdpa_fp16_64x64xDILb0ELi32EEEvNS_19Attention"
    "DescriptorENS_9strides_tES4_S4_S4_S4_S4_S4_PfS5_fS5_S5_S5_S5_S5_Pbii",
    # Trimul: the extension's sm90 CUDA kernels
    "void cueq::kf_zhifan_sm90::project_kernel<128, false, false, false, false, 64, false>("
    "__nv_bfloat16 const*, float const*, float const*, float*, long, CUtensorMap_st, "
    "CUtensorMap_st, CUtensorMap_st, __nv_bfloat16 const*, __nv_bfloat16 const*, float)",
    "_ZN4cueq14kf_zhifan_sm9016fold_output_gateEP13__nv_bfloat16PKS1_S4_i",
    "cueq::kf_zhifan_sm90::fold_output_gate(__nv_bfloat16*, __nv_bfloat16 const*, "
    "__nv_bfloat16 const*, int)",
    "cueq::trimul::x0x1_approx_dual_projection_vjp::(anonymous namespace)::"
    "approx_dual_projection_vjp_kernel(CUtensorMap_st, CUtensorMap_st, CUtensorMap_st, "
    "CUtensorMap_st, __nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16 const*, "
    "__nv_bfloat16*, __nv_bfloat16*, int, int)",
    # ... its prebuilt CuTe DSL cubins (sm_90a: the two-op training kernel, the SM90 training
    # route's projection, contraction-LayerNorm backward and dual-GEMM tails)
    "kernel_cutlass_kernel_kf_trimul_sm90_training_twoop_cd_aottriTriGemmPersistent_object_at__"
    "CopyAtom_ThrID10_TVLayoutSrc1409601_TVLayoutDst1409601_Valuetypebf16_tensor000o128div256641011"
    "12__1",
    "kernel_cutlass_kernel_kf_trimul_sm90_training_twoop_cd_aotewLnInBwd_object_at__tensorptrbf16gm"
    "emalign16odiv2562562561_tensorptrbf16gmemalign16odiv2562562561_tensorptrf32gmemalign16odiv16"
    "3_9",
    "kernel_cutlass_persistent_kernel_kernelMaskedProjectionM128_object_at__CopyAtom_ThrID10_TVLayo"
    "utSrc1819201_TVLayoutDst1819201_Valuetypebf16_tensor00odiv1283841110_CopyAtom_ThrID10_TVLayo"
    "u_0",
    "kernel_cutlass_kernel2_kernelHopperFusedBwdGemm_object_at__CopyAtom_ThrID10_TVLayoutSrc1409601"
    "_TVLayoutDst1409601_Valuetypebf16_tensor000o111012_CopyAtom_ThrID10_TVLayoutSrc1204801_TVLay"
    "o_0",
    "kernel_cutlass__ln_bwd_kernel_tensorptrbf16gmemalign16o256div64i64div641_tensorptrbf16gmemalig"
    "n16odiv642562561_tensorptrf32gmemalign16o2561_tensorptrbf16gmemalign16o256div64i64div641_ten"
    "s_0",
    "kernel_cutlass__affine_reduce_kernel_tensorptrf32gmemalign16o5282562561_tensorptrf32gmemalig"
    "n16o5282562561_tensorptrf32gmemalign16o2561_tensorptrf32gmemalign16o2561_528_4_0",
    "kernel_cutlass_kern_tensorrt_bionemodsl_kernelscutesm90_dual_gemmDualGemmSm90Pingpong_object_a"
    "t__CopyAtom_ThrID10_TVLayoutSrc1409601_TVLayoutDst1409601_Valuetypebf16_tensor00o384111100_C"
    "o_0",
    "kf6240478c55d2d689c767a17f73aae58a436fa2ced6b69ac34d53ffe90a70095" + "_" * 124,
    # ... its Triton kernels (the fallback route: LayerNorm + transpose, gated dual GEMM; the SM90
    # route's LayerNorm VJP and gate VJP)
    "fused_sigmoid_gated_dual_gemm_forward_kernel",
    "fused_sigmoid_gated_dual_gemm_backward_pregemm_kernel",
    "layer_norm_transpose_forward_single_pass_kernel",
    "layer_norm_transpose_backward_kernel",
    "trimul_ln1_vjp_kernel",
    "_gate_vjp_producer_kernel",
    "pairformer_join_norm_gate_kernel",
    # Attention with pair bias (no client's path calls it), Triton
    "_attn_fwd_save_kernel",
    "_pair_bwd_kernel",
    "pair_repr_to_attention_bias_fused_forward_kernel",
    # libcue_ops's tensor products (argument list abbreviated)
    "void kernelcatcher::tensor_product::fused_tensor_product_fwd_kernel<__nv_bfloat16, "
    "__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, (kernelcatcher::tensor_product::"
    "ConnectionModeT)0, 8, false>(kernelcatcher::tensor_product::fused_tensor_product_fwd_params<"
    "__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float>)",
]

PYTORCH = [
    # LayerNorm forward and backward
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, "
    "false>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, "
    "float*, c10::BFloat16*)",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>("
    "int, float, float const*, float const*, float const*, float*, float*, float*)",
    "void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<float, float, "
    "false>(float const*, float const*, float const*, float const*, float const*, float*, int)",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, "
    "32u, 16u, 128u, false, false, false>(long, long, float const*, float const*, float const*, "
    "float const*, float*, float*)",
    # elementwise: add, sigmoid, SiLU, autocast's casts, dropout
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::"
    "CUDAFunctor_add<c10::BFloat16> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<"
    "c10::BFloat16> const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl<at::native::"
    "CUDAFunctor_add<c10::BFloat16> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<"
    "c10::BFloat16> const&)::{lambda(int)#1})",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
    "sigmoid_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#2}::"
    "operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, at::native::"
    "sigmoid_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#2}::"
    "operator()() const::{lambda(float)#1} const&)::{lambda(int)#1}>(int, ...)",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
    "bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}>(at::TensorIteratorBase&"
    ", at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1} const&)::"
    "{lambda(int)#1}>(int, ...)",
    "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float, "
    "unsigned int, 1, 16, bool>(at::cuda::detail::TensorInfo<c10::BFloat16 const, unsigned int>, "
    "at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<bool, "
    "unsigned int>, unsigned int, float, at::PhiloxCudaState)",
    # softmax (the warp kernels sit outside at::; their float form names no c10:: type)
    "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*"
    ", float const*, int, int, int, bool const*, int, bool)",
    "void (anonymous namespace)::softmax_warp_backward<c10::BFloat16, c10::BFloat16, float, 10, "
    "false, false>(c10::BFloat16*, c10::BFloat16 const*, c10::BFloat16 const*, int, int, int, "
    "bool const*)",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<2, double, double, double, "
    "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(double*, double const*, int)",
    # reductions, copies
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<"
    "float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda("
    "float, float)#1}>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, ...>)",
    # the profiler's own names of copies and fills
    "Memcpy DtoD (Device -> Device)",
    "Memset (Device)",
    # scaled_dot_product_attention (Protenix's single track): memory-efficient and flash kernels,
    # whose names carry cutlass:: types, and cuDNN's
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
    "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
    "fmha_cutlassB_bf16_aligned_64x64_k32_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<"
    "cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 32, false>::Params)",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 32, 4, false, false, "
    "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 32, 4, cutlass::bfloat16_t> >, false, "
    "false, false, false, false, false, false, false>(pytorch_flash::Flash_fwd_params)",
    # (cuDNN's runtime-compiled SDPA kernels: a name of their form, not from a dump)
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0",
    # jagged tensors, named after fbgemm (not a GEMM)
    "void at::native::jagged_dense_elementwise_dense_output_kernel_<1, int, c10::BFloat16, "
    "at::native::_fbgemm_jagged_to_padded_dense_forward(at::Tensor const&, c10::ArrayRef<"
    "at::Tensor>, c10::ArrayRef<long>, double)::{lambda()#1}>(...)",
    # Inductor's Triton kernels (names of their form, not from a dump)
    "triton_poi_fused__to_copy_add_mul_0",
    "triton_red_fused_native_layer_norm_1",
]

GEMM = [
    "nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTT",  # as H100 traces show them
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_cgasize1x1x1_warpgroupsize1x1x1_"
    "aligna2_alignc2_execute_segment_k_off_kernel__5x_cublas",
    "void cublasLt::splitKreduce_kernel<32, 16, int, __nv_bfloat16, __nv_bfloat16, float, "
    "__nv_bfloat16, false, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, true, false, false, false>("
    "cublasLt::cublasSplitKParams<float>, ...)",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, 128, 16, "
    "2, 2, false, false, cublasGemvParamsEx<int, cublasGemvTensorBatched<__nv_bfloat16 const>, "
    "cublasGemvTensorBatched<__nv_bfloat16 const>, cublasGemvTensorBatched<__nv_bfloat16>, float> >"
    "(cublasGemvParamsEx<int, cublasGemvTensorBatched<__nv_bfloat16 const>, cublasGemvTensorBatched"
    "<__nv_bfloat16 const>, cublasGemvTensorBatched<__nv_bfloat16>, float>, float, float)",
    # a CUTLASS 2 kernel of cuBLAS (as traces show them)
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>("
    "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8::Params)",
]

TRIFAST = ["_fwd", "_bwd_kv", "_bwd_q", "_bwd_b"]


def short(name: str) -> str:
    """A test id: the name up to its arguments, at most 60 characters."""
    return name.split("(")[0].removeprefix("void ")[:60]


# Each known name and the class it must land in (TriFast's Triton kernels are neither ours nor
# cuEquivariance's: other PyTorch).
EXPECTED = ([(n, "cuequivariance") for n in CUEQUIVARIANCE] + [(n, "other_pytorch") for n in PYTORCH]
            + [(n, "gemm") for n in GEMM] + [(n, "other_pytorch") for n in TRIFAST])


@pytest.mark.parametrize("name,expected", EXPECTED, ids=[short(n) for n, _ in EXPECTED])
def test_known_names_land_in_their_class(name, expected):
    assert breakdown.classify(name) == (expected, True), name


def test_the_table_is_consistent():
    """Every class has a label and a place in the tables; the meta the bench records keeps every
    row (a class may have several)."""
    assert set(breakdown.NAMES) == {c for c, _ in breakdown.CLASSES} == set(breakdown.LABELS)
    assert len(breakdown.NAMES) == len(set(breakdown.NAMES))
    assert set(breakdown.SHORT) == set(breakdown.COLORS) == set(breakdown.NAMES)
