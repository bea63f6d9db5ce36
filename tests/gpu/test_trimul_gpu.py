"""Triangle multiplicative update on CUDA: the kernels against the FP64 CPU reference with
FlashAttention-3's rule (2 x the error of PyTorch in the same precision on the same GPU, plus
rounding noise), for y and every gradient, with freed memory poisoned with NaN so that an unwritten
output element fails; weights and masks read in their own dtypes (bitwise what casts give);
bitwise determinism; streams; opcheck; torch.compile; errors."""
from __future__ import annotations

import pytest
import torch

import tpfkit as tpf
from tpfkit import _C
from tpfkit.ops.trimul import _trimul_bwd, _trimul_fwd

from conftest import poison_allocator
from trimul_cases import (
    GRAD_NAMES,
    WEIGHT_NAMES,
    check_against_reference,
    make_inputs,
    ours,
    run_with_grads,
)

CUDA = "cuda"


def check(B, S, D, dtype, direction, mask, seed, bias=True, weight_dtype=None, mask_dtype=None):
    poison_allocator()
    check_against_reference(B, S, D, dtype, CUDA, direction, mask, seed, bias, weight_dtype,
                            mask_dtype)


@pytest.mark.parametrize("S", [1, 7, 33, 100])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_bf16_against_fp64_reference(S, direction, mask, D, seed):
    check(2, S, D, torch.bfloat16, direction, mask, seed)


@pytest.mark.parametrize("S", [257, 384])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_bf16_large_against_fp64_reference(S, direction, seed):
    check(2, S, 64, torch.bfloat16, direction, True, seed)


# Shapes where one [B, S, S, D] tensor takes 32 MiB or more, at which the held-back input chunks
# (c670101, bench/notes-trimul.md) split the backward's input side: ranges of rows of one sample
# (S = 401: partial tiles, odd offsets into x, the mask, dgo and dx; float32 through its own
# kernel) and whole samples, two per chunk (B = 10, S = 128: five chunks). On main's single pass
# they are large, odd shapes against FP64; on the chunks they check the sums over the chunks.
@pytest.mark.parametrize("B,S,dtype", [(1, 401, torch.bfloat16), (1, 401, torch.float32),
                                       (10, 128, torch.bfloat16)])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_input_chunks_against_fp64_reference(B, S, dtype, direction, seed):
    check(B, S, 128, dtype, direction, True, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("S", [33, 100])
def test_other_dtypes_against_fp64_reference(dtype, direction, S, seed):
    check(2, S, 64, dtype, direction, True, seed)


@pytest.mark.parametrize("D", [8, 24, 72, 120])
def test_channels_not_a_multiple_of_16_or_64_and_no_bias(D, seed):
    for direction in ("outgoing", "incoming"):
        check(2, 70, D, torch.bfloat16, direction, True, seed, bias=False)


# The kernels read the weights in their dtype (float32, bfloat16, float16; one dtype for all) and
# give their gradients in it, and read the mask in its dtype (bool, uint8, float32, bfloat16,
# float16), with no cast kernels around the op.
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("dtype,weight_dtype", [(BF16, BF16), (BF16, FP16), (BF16, FP32),
                                                (FP16, FP16), (FP16, BF16), (FP32, BF16),
                                                (FP32, FP32)])
@pytest.mark.parametrize("mask_dtype", [torch.bool, FP32])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_weight_and_mask_dtypes_against_fp64_reference(dtype, weight_dtype, mask_dtype, direction,
                                                       seed):
    check(2, 70, 64, dtype, direction, True, seed, weight_dtype=weight_dtype,
          mask_dtype=mask_dtype)


@pytest.mark.parametrize("weight_dtype", [BF16, FP16])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_weights_in_their_dtype_match_float32_copies_bitwise(dtype, weight_dtype, seed):
    """Reading 16-bit weights as they are gives what their float32 copies give (the conversion is
    exact), and each weight gradient is the float32 copy's gradient rounded to the weight's dtype."""
    poison_allocator()
    x, m, w, grad = make_inputs(2, 70, 72, dtype, CUDA, seed, mask=True, weight_dtype=weight_dtype)
    y, g = ours(x, m, w, grad, "outgoing")
    y32, g32 = ours(x, m, {k: v.float() for k, v in w.items()}, grad, "outgoing")
    context = f"{dtype} weights {weight_dtype}; seed {seed}"
    assert torch.equal(y, y32), context
    assert torch.equal(g["x"], g32["x"]), context
    for name in WEIGHT_NAMES:
        assert g[name].dtype == weight_dtype, f"d{name} is {g[name].dtype}; {context}"
        assert torch.equal(g[name], g32[name].to(weight_dtype)), f"d{name}; {context}"


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_mask_in_its_dtype_matches_a_mask_of_x_dtype_bitwise(dtype, seed):
    """A mask read in its own dtype gives what the same mask cast to x's dtype gives: bool, uint8
    (also values above 1) and fractional float32, bfloat16 and float16 masks."""
    poison_allocator()
    x, m, w, grad = make_inputs(1, 70, 64, dtype, CUDA, seed, mask=True)
    g = torch.Generator(device=CUDA).manual_seed(seed)
    frac = torch.rand(m.shape, generator=g, device=CUDA) * m
    masks = (m, m.to(torch.uint8) * 3, frac, frac.to(BF16), frac.to(FP16))
    for mask in masks:
        y, gr = ours(x, mask, w, grad, "incoming")
        y_x, gr_x = ours(x, mask.to(dtype), w, grad, "incoming")
        context = f"x {dtype}, mask {mask.dtype}; seed {seed}"
        assert torch.equal(y, y_x), context
        for name in GRAD_NAMES:
            assert torch.equal(gr[name], gr_x[name]), f"d{name}; {context}"


def test_mixed_weight_dtypes_fall_back_to_float32(seed):
    """Weights of several dtypes are cast to float32 in Python (the kernels take one dtype); each
    gradient still comes back in its weight's dtype."""
    poison_allocator()
    x, m, w, grad = make_inputs(1, 33, 64, BF16, CUDA, seed, mask=True)
    mixed = {**w, "p_out_weight": w["p_out_weight"].float(), "norm_in_bias": w["norm_in_bias"].half()}
    y, g = ours(x, m, mixed, grad, "outgoing")
    y32, g32 = ours(x, m, {k: v.float() for k, v in mixed.items()}, grad, "outgoing")
    assert torch.equal(y, y32)
    for name in WEIGHT_NAMES:
        assert g[name].dtype == mixed[name].dtype, name
        assert torch.equal(g[name], g32[name].to(mixed[name].dtype)), name


def test_missing_weights_with_bf16_weights(seed):
    """Missing LayerNorm weights and biases are made in the given weights' dtype (ones and zeros,
    exact); the result is that of float32 ones."""
    x, m, w, grad = make_inputs(1, 33, 64, BF16, CUDA, seed, mask=True, bias=False)
    part = {k: None if k.startswith("norm_") else v for k, v in w.items()}
    y, g = ours(x, m, part, grad, "outgoing")
    y32, g32 = ours(x, m, {k: None if v is None else v.float() for k, v in part.items()}, grad,
                    "outgoing")
    assert torch.equal(y, y32)
    for name in GRAD_NAMES:
        if g[name] is not None:
            assert torch.equal(g[name], g32[name].to(g[name].dtype)), name


def test_cuda_matches_cpu_path_in_float32(seed):
    x, m, w, grad = make_inputs(1, 45, 32, torch.float32, "cpu", seed, mask=True)
    y_cpu, g_cpu = ours(x, m, w, grad, "incoming")
    to = lambda t: None if t is None else t.to(CUDA)
    y_gpu, g_gpu = ours(to(x), to(m), {k: to(v) for k, v in w.items()}, to(grad), "incoming")
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-4, atol=1e-4)
    for name in GRAD_NAMES:
        torch.testing.assert_close(g_gpu[name].cpu(), g_cpu[name], rtol=1e-3, atol=1e-3,
                                   msg=lambda s: f"d{name}: {s}; seed {seed}")


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_bitwise_deterministic(direction, seed):
    x, m, w, grad = make_inputs(1, 384, 128, torch.bfloat16, CUDA, seed, mask=True)
    y0, g0 = ours(x, m, w, grad, direction)
    for call in range(4):
        y1, g1 = ours(x, m, w, grad, direction)
        assert torch.equal(y0, y1), f"y differs on call {call + 2}; seed {seed}"
        for name in GRAD_NAMES:
            assert torch.equal(g0[name], g1[name]), f"d{name} differs on call {call + 2}; seed {seed}"


def test_runs_on_the_current_stream(seed):
    x, m, w, grad = make_inputs(2, 100, 64, torch.bfloat16, CUDA, seed, mask=True)
    y0, g0 = ours(x, m, w, grad, "outgoing")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y1, g1 = ours(x, m, w, grad, "outgoing")
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(y0, y1)
    for name in GRAD_NAMES:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.parametrize("weight_dtype,mask_dtype", [(FP32, BF16), (BF16, torch.bool)])
def test_opcheck_cuda(weight_dtype, mask_dtype):
    x, m, w, grad = make_inputs(2, 9, 16, torch.bfloat16, CUDA, 8, mask=True)
    weights = [torch.empty(0, device=CUDA, dtype=weight_dtype) if w[k] is None
               else w[k].to(weight_dtype) for k in WEIGHT_NAMES]
    m = m.to(mask_dtype)
    torch.library.opcheck(_trimul_fwd, (x.requires_grad_(True), m, weights, True, 1e-5))
    y, a, b, z, go = _trimul_fwd(x.detach(), m, weights, True, 1e-5)
    torch.library.opcheck(_trimul_bwd, (grad, x.detach(), m, weights, a, b, z, go, True, 1e-5))


def test_torch_compile_cuda():
    x, m, w, grad = make_inputs(1, 40, 64, torch.bfloat16, CUDA, 9, mask=True)

    def fn(x, direction, mask, **weights):
        return tpf.triangle_multiplicative_update(x, direction, mask, **weights) * 2

    y_e, g_e = run_with_grads(fn, x, m, w, grad, "outgoing")
    y_c, g_c = run_with_grads(torch.compile(fn, fullgraph=True), x, m, w, grad, "outgoing")
    assert torch.equal(y_c, y_e)
    for name in GRAD_NAMES:
        assert torch.equal(g_c[name], g_e[name]), name


def test_cuda_errors_name_the_argument():
    for D, match in ((12, "multiple of 8"), (136, "at most 128")):
        x, m, w, _ = make_inputs(1, 5, D, torch.bfloat16, CUDA, 1, mask=True)
        with pytest.raises(ValueError, match=match):
            tpf.triangle_multiplicative_update(x, "outgoing", m, **w)
    x, m, w, _ = make_inputs(1, 5, 16, torch.bfloat16, CUDA, 1, mask=True)
    with pytest.raises(ValueError, match="p_out_weight must be on x's device"):
        tpf.triangle_multiplicative_update(x, "outgoing", m, **{**w, "p_out_weight": w["p_out_weight"].cpu()})
    # The custom op's own checks (the public function casts instead).
    weights = [w[k] for k in WEIGHT_NAMES]
    with pytest.raises(ValueError, match="mask must be bool, uint8, float32, bfloat16 or float16"):
        _trimul_fwd(x, m.to(torch.int32), weights, True, 1e-5)
    mixed = [t.float() if k == "g_in_weight" else t for k, t in zip(WEIGHT_NAMES, weights)]
    with pytest.raises(ValueError, match="g_in_weight must have the weights' dtype bfloat16"):
        _trimul_fwd(x, m, mixed, True, 1e-5)
    with pytest.raises(ValueError, match="norm_in_weight .* must be float32, bfloat16 or float16"):
        _trimul_fwd(x, m, [t.double() for t in weights], True, 1e-5)
    y, a, b, z, go = _trimul_fwd(x, m, weights, True, 1e-5)
    grads = [torch.empty_like(x)] + [t.float() for t in weights]
    with pytest.raises(ValueError, match="d_norm_in_weight must have the weights' dtype bfloat16"):
        _C.trimul_backward(x, m, weights, True, 1e-5, a, b, z, go, torch.ones_like(x), grads[0],
                           grads[1:])


# Shapes for the 16-bit kernels' epilogues (from the MMA registers): the forward's 16-byte stores
# of a and b fall back to scalar ones where S is not a multiple of 8: S = 136 takes the vector
# path, the others the scalar one (D is always a multiple of 8, which the op checks, so go and y
# always take the vector path). D = 8, 24, 40 and 72 leave warps with half or none of their 32
# output columns; S = 70, 257 and 136 leave partial tiles. The same shapes cover output_backward's
# stmatrix / ldmatrix epilogues past D and past the tile, and its scalar dz stores where S is not a
# multiple of 8.
@pytest.mark.parametrize("D,S", [(8, 70), (24, 33), (72, 70), (64, 257), (128, 100), (40, 136)])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_epilogue_shapes_against_fp64_reference(D, S, direction, seed):
    check(2, S, D, torch.bfloat16, direction, True, seed, bias=D != 24)
