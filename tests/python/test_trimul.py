"""Triangle multiplicative update on the CPU: the op against the FP64 reference (FlashAttention-3's
rule against plain PyTorch in the same precision), the reference against PyTorch in float64,
cuEquivariance's argument conventions, opcheck, torch.compile and errors."""
from __future__ import annotations

import re

import pytest
import torch

import tpfkit as tpf
from tpfkit import _C
from trimul_cases import (
    WEIGHT_NAMES,
    check_against_reference,
    make_inputs,
    ours,
    reference,
    run_with_grads,
)
from tpfkit.ops.torch_reference import triangle_multiplicative_update_torch
from tpfkit.ops.trimul import _lecun_normal, _trimul_bwd, _trimul_fwd


@pytest.mark.parametrize("S", [1, 7, 33, 100])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_against_fp64_reference(S, direction, mask, dtype, seed):
    check_against_reference(2, S, 16, dtype, "cpu", direction, mask, seed)


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_cpu_channels_not_a_multiple_of_16_no_bias(direction, seed):
    check_against_reference(2, 33, 24, torch.float32, "cpu", direction, True, seed, bias=False)


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_reference_matches_pytorch_in_float64(direction, seed):
    """The C++ reference and the PyTorch implementation (cuEquivariance's formulas) agree."""
    x, m, w, grad = make_inputs(2, 9, 8, torch.float64, "cpu", seed, mask=True)
    y_ref, g_ref = reference(x, m, w, grad, direction)
    y_pt, g_pt = run_with_grads(triangle_multiplicative_update_torch, x, m, w, grad, direction)
    torch.testing.assert_close(y_ref, y_pt, rtol=1e-10, atol=1e-12)
    for name in g_ref:
        torch.testing.assert_close(g_ref[name], g_pt[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda s: f"d{name}: {s}; seed {seed}")


def test_mask_dtypes_and_leading_dimensions():
    x, m, w, _ = make_inputs(2, 10, 8, torch.float32, "cpu", 9, mask=True)
    y = tpf.triangle_multiplicative_update(x, "outgoing", m, **w)
    torch.testing.assert_close(tpf.triangle_multiplicative_update(x, "outgoing", m.float(), **w), y)
    y0 = tpf.triangle_multiplicative_update(x[0], "outgoing", m[0], **w)  # [S, S, D]
    torch.testing.assert_close(y0, y[0])
    x5, m4 = x.reshape(1, 2, *x.shape[1:]), m.reshape(1, 2, *m.shape[1:])
    torch.testing.assert_close(tpf.triangle_multiplicative_update(x5, "outgoing", m4, **w),
                               y.reshape(x5.shape))


def test_missing_weights_follow_cuequivariance_defaults():
    x, _, _, _ = make_inputs(1, 6, 8, torch.float32, "cpu", 2, mask=False)
    torch.manual_seed(1234)
    y = tpf.triangle_multiplicative_update(x)
    torch.manual_seed(1234)
    drawn = {name: _lecun_normal(shape, x.device) for name, shape in
             (("p_in_weight", (16, 8)), ("g_in_weight", (16, 8)), ("p_out_weight", (8, 8)),
              ("g_out_weight", (8, 8)))}
    ones, zeros = torch.ones(8), torch.zeros(8)
    want = triangle_multiplicative_update_torch(
        x, "outgoing", None, ones, zeros, drawn["p_in_weight"], None, drawn["g_in_weight"], None,
        ones, zeros, drawn["p_out_weight"], None, drawn["g_out_weight"], None)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_float32_weights_with_bfloat16_x():
    x, m, w, grad = make_inputs(1, 9, 8, torch.bfloat16, "cpu", 4, mask=True,
                                weight_dtype=torch.float32)
    y, g = ours(x, m, w, grad, "incoming")
    assert y.dtype == torch.bfloat16 and g["x"].dtype == torch.bfloat16
    for name in WEIGHT_NAMES:
        assert g[name].dtype == torch.float32


def test_cpu_bitwise_deterministic(seed):
    x, m, w, grad = make_inputs(2, 40, 16, torch.float32, "cpu", seed, mask=True)
    y0, g0 = ours(x, m, w, grad, "outgoing")
    for _ in range(2):
        y1, g1 = ours(x, m, w, grad, "outgoing")
        assert torch.equal(y0, y1)
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name


def _op_args(device="cpu", dtype=torch.float32, bias=True):
    x, m, w, grad = make_inputs(2, 5, 8, dtype, device, 6, mask=True, bias=bias)
    weights = [torch.empty(0) if w[k] is None else w[k].float() for k in WEIGHT_NAMES]
    return x, m.to(dtype), weights, grad


@pytest.mark.parametrize("bias", [True, False])
def test_opcheck(bias):
    x, m, weights, grad = _op_args(bias=bias)
    x.requires_grad_(True)
    for w in weights:
        if w.numel():
            w.requires_grad_(True)
    torch.library.opcheck(_trimul_fwd, (x, m, weights, True, 1e-5))
    plain = [w.detach() for w in weights]
    y, a, b, z, go = _trimul_fwd(x.detach(), m, plain, False, 1e-5)
    torch.library.opcheck(_trimul_bwd, (grad, x.detach(), m, plain, a, b, z, go, False, 1e-5))


def test_torch_compile_matches_eager():
    x, m, w, grad = make_inputs(1, 12, 8, torch.float32, "cpu", 10, mask=True)

    def fn(x, direction, mask, **weights):
        return tpf.triangle_multiplicative_update(x, direction, mask, **weights) * 2

    compiled = torch.compile(fn, fullgraph=True)
    y_e, g_e = run_with_grads(fn, x, m, w, grad, "incoming")
    y_c, g_c = run_with_grads(compiled, x, m, w, grad, "incoming")
    torch.testing.assert_close(y_c, y_e)
    for name in g_e:
        torch.testing.assert_close(g_c[name], g_e[name])


def test_cpu_bfloat16_weights_give_gradients_in_bfloat16(seed):
    """The CPU path casts the weights to float32 in Python; their gradients come back in the
    weights' dtype, equal to the gradients of float32 copies rounded to it."""
    x, m, w, grad = make_inputs(1, 9, 8, torch.float32, "cpu", seed, mask=True,
                                weight_dtype=torch.bfloat16)
    y, g = ours(x, m, w, grad, "outgoing")
    y32, g32 = ours(x, m, {k: v.float() for k, v in w.items()}, grad, "outgoing")
    assert torch.equal(y, y32) and torch.equal(g["x"], g32["x"])
    for name in WEIGHT_NAMES:
        assert g[name].dtype == torch.bfloat16, name
        assert torch.equal(g[name], g32[name].to(torch.bfloat16)), name


def test_mask_dtype_errors():
    x, m, w, _ = make_inputs(1, 5, 8, torch.float32, "cpu", 1, mask=True)
    with pytest.raises(TypeError, match="mask must be a bool, integer or floating-point tensor"):
        tpf.triangle_multiplicative_update(x, "outgoing", m.to(torch.complex64), **w)
    # The CPU path itself takes the mask in x's dtype only (the op casts it there).
    weights = [torch.empty(0) if w[k] is None else w[k] for k in WEIGHT_NAMES]
    y = torch.empty_like(x)
    saved = [torch.empty(1, 8, 5, 5) for _ in range(3)] + [torch.empty_like(x)]
    with pytest.raises(ValueError, match="mask must have x's dtype float32, got bool"):
        _C.trimul_forward(x, m, weights, True, 1e-5, y, *saved)


# make_inputs(1, 5, 8, ...): x [1, 5, 5, 8], mask [1, 5, 5], D = 8.
BAD_INPUTS = [
    (ValueError, "direction must be 'outgoing' or 'incoming', got 'sideways'",
     lambda x, m, w: ((x, "sideways", m), w)),
    (ValueError, "x must be float32, bfloat16 or float16, got int32",
     lambda x, m, w: ((x.to(torch.int32), "outgoing", m), w)),
    (ValueError, "x must be float32, bfloat16 or float16, got float64",
     lambda x, m, w: ((x.double(), "outgoing", m), w)),
    (ValueError, "x must have shape [B, S, S, D] (or [S, S, D]), got [5, 8]",
     lambda x, m, w: ((x[0, 0], "outgoing", None), w)),
    (ValueError, "x must be square in its two middle dimensions [B, S, S, D], got [1, 5, 4, 8]",
     lambda x, m, w: ((x[:, :, :4], "outgoing", None), w)),
    (ValueError, "mask must have shape [B, S, S] = [1, 5, 5], got [1, 4, 5]",
     lambda x, m, w: ((x, "outgoing", m[:, :4]), w)),
    (ValueError, "mask must not require grad",
     lambda x, m, w: ((x, "outgoing", m.float().requires_grad_(True)), w)),
    (TypeError, "mask must be a bool, integer or floating-point tensor, got torch.complex64",
     lambda x, m, w: ((x, "outgoing", m.to(torch.complex64)), w)),
    (ValueError, "p_in_weight must have shape [2D, D] = [16, 8], got [8, 16]",
     lambda x, m, w: ((x, "outgoing", m), {**w, "p_in_weight": w["p_in_weight"].t()})),
    (ValueError, "g_out_bias must have shape [D] = [8], got [7]",
     lambda x, m, w: ((x, "outgoing", m), {**w, "g_out_bias": w["g_out_bias"][:-1]})),
    (TypeError, "g_in_weight must be a floating-point tensor, got torch.int64",
     lambda x, m, w: ((x, "outgoing", m), {**w, "g_in_weight": w["g_in_weight"].long()})),
    (TypeError, "norm_in_weight must be a torch.Tensor, got list",
     lambda x, m, w: ((x, "outgoing", m), {**w, "norm_in_weight": [1.0] * 8})),
    (ValueError, "precision must be None or 'ieee', got 'tf32'",
     lambda x, m, w: ((x, "outgoing", m), {**w, "precision": "tf32"})),
    (ValueError, "eps must be a positive number, got 0",
     lambda x, m, w: ((x, "outgoing", m), {**w, "eps": 0.0})),
    (TypeError, "eps must be a number, got str",
     lambda x, m, w: ((x, "outgoing", m), {**w, "eps": "1e-5"})),
    (TypeError, "x must be a torch.Tensor, got ndarray",
     lambda x, m, w: ((x.numpy(), "outgoing", m), w)),
]


@pytest.mark.parametrize("kind,message,mutate", BAD_INPUTS, ids=[m for _, m, _ in BAD_INPUTS])
def test_errors_name_the_argument(kind, message, mutate):
    x, m, w, _ = make_inputs(1, 5, 8, torch.float32, "cpu", 1, mask=True)
    args, kwargs = mutate(x, m, w)
    with pytest.raises(kind, match=re.escape(message)):
        tpf.triangle_multiplicative_update(*args, **kwargs)