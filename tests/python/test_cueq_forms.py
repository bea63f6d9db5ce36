"""The argument forms cuEquivariance's functions take, which our ops take as it does (the clients
pass them): triangle attention's B = 1 form without the batch dimension, masks of any dtype, a
float32 bias with 16-bit q, k, v, autocast; the triangle multiplication's mask without the batch
dimension and autocast."""
from __future__ import annotations

import pytest
import torch

import tpfkit as tpf
from attention_cases import GRADS, check_fa3_rule, make_case, reference_fp64, run_with_grads
from trimul_cases import make_inputs
from tpfkit.ops.torch_reference import triangle_attention_torch


def test_attention_batchless_form_returns_cuequivariance_shape(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 5, 2, 13, 8, torch.float32, "cpu", g)
    ours = tpf.triangle_attention(q, k, v, bias, mask)
    # q, k, v [N, H, S, D], bias [1, H, S, S] or [H, S, S], mask [N, 1, 1, S] or [B, N, S]
    for b in (bias[0], bias[0, 0]):
        for m in (mask[0], mask.reshape(1, 5, 13)):
            o = tpf.triangle_attention(q[0], k[0], v[0], b, m)
            assert o.shape == (1, 5, 2, 13, 8)  # cuEquivariance's output keeps B = 1
            assert torch.equal(o, ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int64, torch.bfloat16])
def test_attention_mask_of_any_dtype_is_nonzero_attends(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(2, 3, 2, 9, 8, torch.float32, "cpu", g)
    assert torch.equal(tpf.triangle_attention(q, k, v, bias, mask.to(dtype)),
                       tpf.triangle_attention(q, k, v, bias, mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_float32_bias_with_16_bit_inputs(dtype, seed):
    """Every bit of the bias is used (no rounding to q's dtype); its gradient is float32 and
    q, k, v's are in their dtype; by FlashAttention-3's rule against PyTorch with the bias
    rounded to q's dtype, the best its einsums can take."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, _, mask, grad = make_case(2, 3, 2, 21, 16, dtype, "cpu", g)
    bias = torch.randn(2, 1, 2, 21, 21, generator=g)
    ours = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    assert ours["o"].dtype == dtype and ours["dbias"].dtype == torch.float32
    assert all(ours[n].dtype == dtype for n in ("dq", "dk", "dv"))
    base = run_with_grads(lambda q, k, v, b, m: triangle_attention_torch(q, k, v, b.to(dtype), m),
                          q, k, v, bias, mask, grad)
    ref = reference_fp64(*(t.double() for t in (q, k, v, bias)), mask, grad.double(), 16 ** -0.5)
    check_fa3_rule(ours, base, ref, dtype, f"({dtype}, float32 bias, seed {seed})")
    # The float32 bits matter: rounding the bias first gives another o.
    rounded = tpf.triangle_attention(q, k, v, bias.to(dtype).float(), mask)
    assert not torch.equal(rounded, ours["o"])


def test_attention_follows_autocast(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(1, 3, 2, 11, 8, torch.float32, "cpu", g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = tpf.triangle_attention(q, k, v, bias.bfloat16(), mask)
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, tpf.triangle_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                 bias.bfloat16(), mask))


def test_attention_errors_for_forms_cuequivariance_rejects_too(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(2, 3, 2, 6, 8, torch.float32, "cpu", g)
    with pytest.raises(ValueError, match="bias must have shape"):
        tpf.triangle_attention(q, k, v, bias[0, 0], mask)  # [H, S, S] only goes with B = 1
    with pytest.raises(ValueError, match="q must have 5 dimensions"):
        tpf.triangle_attention(q[0, 0], k[0, 0], v[0, 0], bias, mask)


def test_trimul_mask_without_batch_dim(seed):
    x, m, w, grad = make_inputs(1, 9, 8, torch.float32, "cpu", seed, mask=True)
    y = tpf.triangle_multiplicative_update(x, "incoming", m, **w)
    assert torch.equal(tpf.triangle_multiplicative_update(x, "incoming", m[0], **w), y)


def test_trimul_follows_autocast(seed):
    """A float32 x with float32 weights under bf16 autocast (Boltz) runs as a bf16 x would."""
    x, m, w, grad = make_inputs(1, 9, 8, torch.float32, "cpu", seed, mask=True)
    leaf = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tpf.triangle_multiplicative_update(leaf, "outgoing", m, **w)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, tpf.triangle_multiplicative_update(x.bfloat16(), "outgoing", m, **w))
    y.backward(grad.bfloat16())
    assert leaf.grad.dtype == torch.float32


def test_forms_cover_gradients_of_the_batchless_form(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(1, 4, 2, 10, 8, torch.float32, "cpu", g)
    full = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    batchless = run_with_grads(lambda q, k, v, b, m: tpf.triangle_attention(q[0], k[0], v[0], b, m),
                               q, k, v, bias, mask[0], grad)
    for name in ("o",) + GRADS:
        assert torch.equal(full[name], batchless[name]), name
