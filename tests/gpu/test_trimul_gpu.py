"""Triangle multiplicative update on CUDA: the kernels against the FP64 CPU reference with
FlashAttention-3's rule (2 x the error of PyTorch in the same precision on the same GPU, plus
rounding noise), for y and every gradient, with freed memory poisoned with NaN so that an unwritten
output element fails; bitwise determinism; streams; opcheck; torch.compile; errors."""
from __future__ import annotations

import pytest
import torch

import turbopairformer as tpf
from turbopairformer.ops.trimul import _trimul_bwd, _trimul_fwd

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


def check(B, S, D, dtype, direction, mask, seed, bias=True):
    poison_allocator()
    check_against_reference(B, S, D, dtype, CUDA, direction, mask, seed, bias)


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("S", [33, 100])
def test_other_dtypes_against_fp64_reference(dtype, direction, S, seed):
    check(2, S, 64, dtype, direction, True, seed)


@pytest.mark.parametrize("D", [8, 24, 72, 120])
def test_channels_not_a_multiple_of_16_or_64_and_no_bias(D, seed):
    for direction in ("outgoing", "incoming"):
        check(2, 70, D, torch.bfloat16, direction, True, seed, bias=False)


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


def test_opcheck_cuda():
    x, m, w, grad = make_inputs(2, 9, 16, torch.bfloat16, CUDA, 8, mask=True)
    weights = [torch.empty(0, device=CUDA) if w[k] is None else w[k].float() for k in WEIGHT_NAMES]
    m = m.to(x.dtype)
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


# The kernel variants that TPF_TRIMUL_VARIANT selects (src/kernels/trimul/launch.h; every other
# test runs the default, variant 3, or whatever the variable says): 0, the fused kernels' GEMMs
# through WMMA and the IEEE sigmoid; 1, through mma.sync with ldmatrix fragments; 2, also
# input_backward's epilogue changes. The default's forward epilogues (from the MMA registers) fall
# back from 16-byte stores of a and b to scalar ones where S is not a multiple of 8: S = 136 takes
# the vector path, the others the scalar one (D is always a multiple of 8, which the op checks, so
# go and y always take the vector path). D = 8, 24, 40 and 72 leave warps with half or none of
# their 32 output columns; S = 70, 257 and 136 leave partial tiles. 4 is variant 3 with
# output_backward at 3 CTAs per SM (epilogues from the MMA registers, grid 396): the same shapes
# cover its stmatrix / ldmatrix epilogues past D and past the tile, and the scalar dz stores
# where S is not a multiple of 8.
VARIANTS = ["0", "1", "2", "3", "4"]  # 3 also runs unset: the shapes above are for its epilogues


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D,S", [(8, 70), (24, 33), (72, 70), (64, 257), (128, 100), (40, 136)])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_variant_against_fp64_reference(monkeypatch, variant, D, S, direction, seed):
    monkeypatch.setenv("TPF_TRIMUL_VARIANT", variant)
    check(2, S, D, torch.bfloat16, direction, True, seed, bias=D != 24)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_variant_other_dtypes_against_fp64_reference(monkeypatch, variant, dtype, seed):
    monkeypatch.setenv("TPF_TRIMUL_VARIANT", variant)
    check(2, 100, 64, dtype, "incoming", True, seed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_bitwise_deterministic(monkeypatch, variant, seed):
    monkeypatch.setenv("TPF_TRIMUL_VARIANT", variant)
    x, m, w, grad = make_inputs(1, 384, 128, torch.bfloat16, CUDA, seed, mask=True)
    y0, g0 = ours(x, m, w, grad, "outgoing")
    for call in range(4):
        y1, g1 = ours(x, m, w, grad, "outgoing")
        assert torch.equal(y0, y1), f"y differs on call {call + 2} (variant {variant}); seed {seed}"
        for name in GRAD_NAMES:
            assert torch.equal(g0[name], g1[name]), (
                f"d{name} differs on call {call + 2} (variant {variant}); seed {seed}")


def test_unknown_variant_names_the_variable(monkeypatch):
    x, m, w, _ = make_inputs(1, 5, 16, torch.bfloat16, CUDA, 1, mask=True)
    monkeypatch.setenv("TPF_TRIMUL_VARIANT", "7")
    with pytest.raises(ValueError, match="TPF_TRIMUL_VARIANT"):
        tpf.triangle_multiplicative_update(x, "outgoing", m, **w)
