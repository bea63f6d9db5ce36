"""Triangle attention on the CPU: the op against the FP64 reference (FlashAttention-3's rule),
determinism, output-residual compensation, bad input, opcheck and torch.compile."""
import math
import re

import pytest
import torch

import tpfkit as tpf
from tpfkit.ops.attention import _attention_bwd, _attention_fwd
from tpfkit.ops.torch_reference import triangle_attention_torch

from attention_cases import (BAD_INPUTS, GRADS, bad_input_message, attention_finite_rows_torch, check_fa3_rule, make_case, max_err,
                             reference_fp64, residual_squared_errors, run_with_grads, with_minus_inf_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("H", [1, 4])
@pytest.mark.parametrize("S", [1, 7, 33, 100])
def test_matches_fp64_reference(S, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    N = min(S, 12)
    q, k, v, bias, mask, grad = make_case(2, N, H, S, D, dtype, "cpu", g)
    scale = 1 / math.sqrt(D)
    ref = reference_fp64(q, k, v, bias, mask, grad, scale)
    ours = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    base = run_with_grads(triangle_attention_torch, q, k, v, bias, mask, grad)
    check_fa3_rule(ours, base, ref, dtype, f"(S={S}, H={H}, D={D}, {dtype})")
    # The slice with no key: zeros and zero gradients, never NaN.
    for name in ("o", "dq", "dk", "dv"):
        assert (ours[name][-1, N - 1] == 0).all(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("kind", ["first-key-tile", "every-key"])
def test_minus_infinity_in_the_bias(kind, masked, dtype, seed):
    """A bias of -inf (an additive mask): rows with no finite score in the first key tile but one
    later (the CPU path's online softmax gave NaN there, exp(-inf - -inf)), and rows with none at
    all (zeros and zero gradients, like fully masked rows). FP64 rule, no NaN."""
    g = torch.Generator().manual_seed(seed)
    S, D = 150, 16
    q, k, v, bias, mask, grad = make_case(2, 3, 2, S, D, dtype, "cpu", g)
    mask = mask if masked else None
    bias = with_minus_inf_bias(bias, kind)
    ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(D))
    ours = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    base = run_with_grads(attention_finite_rows_torch, q, k, v, bias, mask, grad)
    check_fa3_rule(ours, base, ref, dtype, f"({kind}, masked={masked}, {dtype}, seed {seed})")
    if kind == "every-key":
        for name in ("o", "dq", "dbias"):
            assert (ours[name][..., 3::7, :] == 0).all(), f"{name} of rows with no finite score"


def test_compact_and_cuequivariance_shapes_agree(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(2, 5, 3, 17, 16, torch.float32, "cpu", g)
    B, N, H, S, _ = q.shape
    a = tpf.triangle_attention(q, k, v, bias, mask)
    b = tpf.triangle_attention(q, k, v, bias.reshape(B, H, S, S), mask.reshape(B, N, S))
    assert torch.equal(a, b)


def test_no_mask_equals_all_true_mask(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 3, 2, 9, 16, torch.float32, "cpu", g)
    assert torch.equal(tpf.triangle_attention(q, k, v, bias),
                       tpf.triangle_attention(q, k, v, bias, torch.ones_like(mask)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_deterministic(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    case = make_case(2, 6, 4, 70, 32, dtype, "cpu", g)
    first = run_with_grads(tpf.triangle_attention, *case)
    for _ in range(4):
        again = run_with_grads(tpf.triangle_attention, *case)
        for name in ("o",) + GRADS:
            assert torch.equal(first[name], again[name]), name


def test_residual_lowers_gradient_error(seed):
    """Output-residual compensation: dQ, dK and dbias closer to FP64 for bfloat16 inputs.

    Reports the reduction of the total error and of the error above the floor that rounding the
    FP64 gradient once to bfloat16 sets (the part the algorithm controls)."""
    sq = residual_squared_errors(16, 64, "cpu", torch.Generator().manual_seed(seed))
    total = {n: 1 - math.sqrt(a / b) for n, (a, b, _) in sq.items()}
    excess = {n: 1 - math.sqrt(max(a - f, 0) / max(b - f, 1e-300)) for n, (a, b, f) in sq.items()}
    print("residual: error reduction, total:", {n: f"{100 * r:.1f}%" for n, r in total.items()},
          "above the bf16 rounding floor:", {n: f"{100 * r:.1f}%" for n, r in excess.items()})
    for name in ("dq", "dk", "dbias"):
        assert total[name] > 0.02 and excess[name] > 0.25, (name, total, excess)
    assert total["dv"] == 0  # the residual enters only the softmax correction


@pytest.mark.parametrize("message,mutate", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_input_names_the_argument(message, mutate, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 3, 2, 6, 8, torch.float32, "cpu", g)
    with pytest.raises((ValueError, TypeError), match=re.escape(bad_input_message(message, q))):
        tpf.triangle_attention(*mutate(q, k, v, bias, mask))


def test_non_contiguous_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 4, 2, 11, 16, torch.float32, "cpu", g)
    # Strided views (slice-major layouts, transposed feature storage) give the same result.
    qt = q.transpose(1, 3).contiguous().transpose(1, 3)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert torch.equal(tpf.triangle_attention(qt, kt, v, bias, mask),
                       tpf.triangle_attention(q, k, v, bias, mask))


def test_scale_argument(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 2, 1, 5, 8, torch.float32, "cpu", g)
    ours = tpf.triangle_attention(q, k, v, bias, mask, scale=0.7)
    base = triangle_attention_torch(q, k, v, bias, mask, scale=0.7)
    assert max_err(ours, base.double()) < 1e-5
    with pytest.raises(ValueError, match="scale must be a finite nonzero number, got nan"):
        tpf.triangle_attention(q, k, v, bias, mask, scale=float("nan"))
    with pytest.raises(ValueError, match="scale must be a finite nonzero number, got 0"):
        tpf.triangle_attention(q, k, v, bias, mask, scale=0.0)
    with pytest.raises(TypeError, match="scale must be a number or None, got str"):
        tpf.triangle_attention(q, k, v, bias, mask, scale="0.5")


def test_rows_match_full_attention(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(2, 3, 2, 19, 16, torch.float32, "cpu", g)
    B, N, H, S, _ = q.shape
    full = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    rows = slice(5, 13)
    part = tpf.triangle_attention_rows(q[:, :, :, rows], k, v, bias.reshape(B, H, S, S)[:, :, rows],
                                       mask.reshape(B, N, S))
    assert (part - full["o"][:, :, :, rows]).abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(1, 3, 2, 9, 16, dtype, "cpu", g)
    B, N, H, S, _ = q.shape
    args = [t.requires_grad_(True) for t in (q, k, v, bias.reshape(B, H, S, S))]
    torch.library.opcheck(_attention_fwd, (*args, mask.reshape(B, N, S), 0.25, True))
    o, lse, residual = _attention_fwd(*[a.detach() for a in args], mask.reshape(B, N, S), 0.25, True)
    torch.library.opcheck(_attention_bwd, (grad, *[a.detach() for a in args], mask.reshape(B, N, S),
                                           o, lse, residual, 0.25))


def test_torch_compile(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(1, 4, 2, 13, 16, torch.float32, "cpu", g)

    def model(q, k, v, bias, mask):
        return torch.nn.functional.gelu(tpf.triangle_attention(q * 2, k, v, bias, mask)) * 3

    compiled = torch.compile(model, fullgraph=True)
    eager = run_with_grads(model, q, k, v, bias, mask, grad)
    comp = run_with_grads(compiled, q, k, v, bias, mask, grad)
    for name in ("o",) + GRADS:
        assert torch.allclose(eager[name], comp[name], atol=1e-5, rtol=1e-5), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_bias_is_read_unrounded(dtype, seed):
    """A float32 bias with 16-bit q, k, v (Protenix passes bias.float()): O and the gradients
    within the FP64 rule, and O closer to FP64 than with the bias rounded to q's dtype (a bias
    of spread 8, where that rounding moves scores by up to 8 x 2^-9)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(2, 5, 2, 70, 16, dtype, "cpu", g)
    bias = bias.float() * 8 + torch.rand(bias.shape, generator=g) * 1e-2
    ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(16))
    ours = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    base = run_with_grads(triangle_attention_torch, q, k, v, bias.to(dtype), mask, grad)
    check_fa3_rule(ours, base, ref, dtype, f"(float32 bias, {dtype})")
    assert ours["dbias"].dtype == torch.float32
    # O before its rounding to q's dtype (O + its residual): the rounded O's largest error is its
    # output rounding, which both biases can share at the same element (seed 991641002: equal).
    def unrounded_o(b):
        B, N, H, S, _ = q.shape
        o, _, res = torch.ops.tpfkit.triangle_attention_fwd(
            q, k, v, b.reshape(B, H, S, S), mask.reshape(B, N, S), 1 / math.sqrt(16), True)
        return o.double() + res.double()
    assert max_err(unrounded_o(bias), ref["o"]) < max_err(unrounded_o(bias.to(dtype)), ref["o"])


def test_bench_rounding_floor():
    """bench/attention.py's floor row: the FP64 results stored in the outputs' dtypes. bf16 stores
    ~0.166 % (2^-8 / sqrt(3) x the spread of mantissas) on the bench's inputs, float32 ~1e-6 %, and
    an output with errors of its own lands above it."""
    from tpfkit.benchmarks.attention import make_inputs
    from tpfkit.benchmarks.attention_gpu import reference_fp64, rounding_floor, rel_err_percent

    q, k, v, bias, mask, grad = make_inputs(48, 16, 2, torch.bfloat16, torch.device("cpu"), seed=7)
    ref = reference_fp64(q, k, v, bias, mask, grad)
    bf16 = rounding_floor(ref, torch.bfloat16, torch.bfloat16)
    assert set(bf16) == {f"rel_err_{n}" for n in ("O", "dQ", "dK", "dV", "dbias")}
    for name, err in bf16.items():
        assert 0.12 < err < 0.22, (name, err)
    f32_bias = rounding_floor(ref, torch.bfloat16, torch.float32)
    assert f32_bias["rel_err_dbias"] < 1e-4 and f32_bias["rel_err_O"] == bf16["rel_err_O"]
    noisy = ref["o"] * (1 + 4e-3 * torch.randn(ref["o"].shape, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(1)))
    assert rel_err_percent(noisy.to(torch.bfloat16), ref["o"]) > bf16["rel_err_O"]
