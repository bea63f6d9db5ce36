"""Triangle attention CUDA kernels against the FP64 reference (FlashAttention-3's rule),
bitwise determinism, the residual's effect, chunked backward, strided inputs, CUDA graphs."""
import math

import pytest
import torch

import tpfkit as tpf
from tpfkit.ops.torch_reference import triangle_attention_torch

from accuracy import assert_accurate
from attention_cases import (BAD_INPUTS, GRADS, ROUNDINGS_16BIT, attention_finite_rows_torch, check_fa3_rule,
                             make_case, max_err, reference_fp64, residual_squared_errors,
                             run_with_grads, with_minus_inf_bias)
from conftest import poison_allocator

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("S", [1, 33, 100, 257, 384])
def test_matches_fp64_reference(S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    N = min(S, 24)
    q, k, v, bias, mask, grad = make_case(2, N, 4, S, D, dtype, "cuda", g)
    ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(D))
    poison_allocator()
    ours = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    base = run_with_grads(triangle_attention_torch, q, k, v, bias, mask, grad)
    check_fa3_rule(ours, base, ref, dtype, f"(S={S}, D={D}, {dtype}, seed {seed})")
    for name in ("o", "dq", "dk", "dv"):
        assert (ours[name][-1, N - 1] == 0).all(), f"{name} of the fully masked slice is not zero"


def mixed_tile_mask(B, N, S, g):
    """Key masks [B, N, 1, 1, S] whose 64-key tiles are whole in some slices and not in others:
    every key (all tiles whole but a short tail), the tail 10% masked, one key of the second tile
    masked, 80% kept at random (no tile whole), none (a fully masked slice), in turn."""
    mask = torch.ones(B, N, 1, 1, S, dtype=torch.bool)
    for i in range(B * N):
        b, n = divmod(i, N)
        kind = i % 5
        if kind == 1:
            mask[b, n, ..., S - max(1, S // 10):] = False
        elif kind == 2:
            mask[b, n, ..., min(S - 1, 70)] = False
        elif kind == 3:
            mask[b, n] = torch.rand(1, 1, S, generator=g) < 0.8
        elif kind == 4:
            mask[b, n] = False
    return mask


def check_whole_and_masked_tiles(S, D, dtype, masked, seed, label="default"):
    """Whole 64-key tiles (which may take a path without the key flags) meeting masked ones in one
    launch (mixed_tile_mask), or mask=None (every tile whole but the tail): FP64 rule, fully
    masked slices zero, bitwise reproducible."""
    g = torch.Generator().manual_seed(seed)
    B, N = 2, 5
    q, k, v, bias, _, grad = make_case(B, N, 4, S, D, dtype, "cuda", g)
    mask = mixed_tile_mask(B, N, S, g).to("cuda") if masked else None
    ours = check_fp64_and_repeatable(
        q, k, v, bias, mask, grad, dtype,
        f"({label}, S={S}, D={D}, {dtype}, masked={masked}, seed {seed})")
    if masked:  # slice 4 of batch 0 (kind 4) attends to nothing
        for name in ("o", "dq", "dk", "dv"):
            assert (ours[name][0, 4] == 0).all(), f"{name} of the fully masked slice is not zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("S", [64, 200, 257])
@pytest.mark.parametrize("masked", [True, False])
def test_whole_and_masked_key_tiles(S, D, dtype, masked, seed):
    """The random masks of make_case leave no 64-key tile whole (0.8^64); these do."""
    check_whole_and_masked_tiles(S, D, dtype, masked, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("kind", ["first-key-tile", "every-key"])
def test_minus_infinity_in_the_bias(kind, masked, D, dtype, seed):
    """A bias of -inf (an additive mask): rows with no finite score in the first key tile but one
    later, and rows with none at all (zeros and zero gradients, like fully masked rows). FP64
    rule against a PyTorch baseline that zeroes such rows, no NaN, bitwise reproducible."""
    g = torch.Generator().manual_seed(seed)
    S = 150
    q, k, v, bias, mask, grad = make_case(2, 3, 4, S, D, dtype, "cuda", g)
    mask = mask if masked else None
    bias = with_minus_inf_bias(bias, kind)
    ours = check_fp64_and_repeatable(q, k, v, bias, mask, grad, dtype,
                                     f"({kind}, masked={masked}, D={D}, {dtype}, seed {seed})",
                                     baseline=attention_finite_rows_torch)
    if kind == "every-key":
        for name in ("o", "dq", "dbias"):
            assert (ours[name][..., 3::7, :] == 0).all(), f"{name} of rows with no finite score"


@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("S,N", [(100, 12), (257, 9)])
def test_bitwise_deterministic(S, N, D, seed):
    """All four gradients bitwise identical over 5 calls, on 100 random inputs per shape."""
    g = torch.Generator().manual_seed(seed)
    for case in range(100):
        inputs = make_case(1, N, 4, S, D, torch.bfloat16, "cuda", g)
        first = run_with_grads(tpf.triangle_attention, *inputs)
        for _ in range(4):
            again = run_with_grads(tpf.triangle_attention, *inputs)
            for name in GRADS:
                assert torch.equal(first[name], again[name]), f"{name} differs (input {case})"


@pytest.mark.parametrize("D", [16, 32, 64])
def test_chunked_backward_matches_single_chunk(monkeypatch, D, seed):
    """A small workspace budget splits the slices into chunks of one slice group (one launch each);
    the gradients stay within the FP64 rule and are bitwise the single launch's: dQ and dbias are
    added in the same order (key blocks, then slice groups) however the slices are chunked."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(1, 37, 2, 200, D, torch.bfloat16, "cuda", g)
    ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(D))
    monkeypatch.delenv("TPF_ATTENTION_DQ_BUDGET_BYTES", raising=False)
    whole = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    monkeypatch.setenv("TPF_ATTENTION_DQ_BUDGET_BYTES", "1")
    ours = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    base = run_with_grads(triangle_attention_torch, q, k, v, bias, mask, grad)
    check_fa3_rule(ours, base, ref, torch.bfloat16, f"(chunked, D={D})")
    for name in GRADS:
        assert torch.equal(ours[name], whole[name]), f"{name}: chunked differs from one launch"


def test_workspace_budget_sets_the_chunks(monkeypatch, seed):
    """The budget variable the chunked test relies on lowers the backward's peak memory (its fp32
    dQ accumulator then holds one slice group, not all 37 slices), so the test above does run
    many launches."""
    g = torch.Generator().manual_seed(seed)
    inputs = make_case(1, 37, 2, 200, 32, torch.bfloat16, "cuda", g)

    def peak():
        run_with_grads(tpf.triangle_attention, *inputs)  # warm: outputs cached by the allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run_with_grads(tpf.triangle_attention, *inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    monkeypatch.delenv("TPF_ATTENTION_DQ_BUDGET_BYTES", raising=False)
    big = peak()
    monkeypatch.setenv("TPF_ATTENTION_DQ_BUDGET_BYTES", "1")
    small = peak()
    # 36 slices' dQ accumulators less (19 groups of 2 slices against one group): 36 x 2 heads x
    # 256 padded rows x 32 x 4 bytes; half of it as the bound (other scratch may differ).
    assert big - small >= 36 * 2 * 256 * 32 * 4 // 2, (small, big)


@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_backward(D, dtype, seed):
    """q, k, v and the output gradient as strided views (q and k halves of one packed tensor in
    [B, N, S, H, 2D] storage, v with rows off 16-byte boundaries, the output gradient permuted): the
    outputs and gradients are bitwise those of contiguous copies."""
    g = torch.Generator().manual_seed(seed)
    B, N, H, S = 2, 5, 3, 150
    q, k, v, bias, mask, grad = make_case(B, N, H, S, D, dtype, "cuda", g)
    # Leaves in strided storage (a clone would not keep the strides of a half of a tensor).
    packed = torch.cat([q, k], dim=-1).transpose(2, 3).contiguous().transpose(2, 3)
    packed = packed.detach().requires_grad_(True)
    # v one element past a 16-byte boundary: rows no longer aligned (the copies' scalar path).
    v_s = torch.empty(*v.shape[:-1], D + 1, dtype=dtype, device="cuda")[..., 1:]
    v_s.copy_(v)
    v_s = v_s.detach().requires_grad_(True)
    bias_s = bias.detach().clone().requires_grad_(True)
    grad_s = grad.transpose(2, 3).contiguous().transpose(2, 3)
    q_s, k_s = packed[..., :D], packed[..., D:]
    assert not q_s.is_contiguous() and not v_s.is_contiguous() and not grad_s.is_contiguous()
    o = tpf.triangle_attention(q_s, k_s, v_s, bias_s, mask)
    o.backward(grad_s)
    strided = {"o": o.detach(), "dq": packed.grad[..., :D], "dk": packed.grad[..., D:],
               "dv": v_s.grad, "dbias": bias_s.grad}
    dense = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    for name in ("o",) + tuple(GRADS):
        assert torch.equal(strided[name], dense[name]), f"{name} differs with strided inputs"


@pytest.mark.parametrize("D", [16, 32, 64])
def test_dead_key_blocks_and_slices(D, seed):
    """Keys 128..255 masked in every slice (every CTA of that key block has nothing to compute but
    still takes its turn in the ordered sums), the last S/8 keys masked, and whole masked slices:
    FP64 rule, zero gradients where nothing attends, bitwise reproducible."""
    g = torch.Generator().manual_seed(seed)
    B, N, S = 2, 7, 300
    q, k, v, bias, _, grad = make_case(B, N, 2, S, D, torch.bfloat16, "cuda", g)
    mask = torch.ones(B, N, 1, 1, S, dtype=torch.bool)
    mask[..., 128:256] = False
    mask[..., S - S // 8:] = False
    mask[0, 2] = False
    mask[1, 6] = False
    ours = check_fp64_and_repeatable(q, k, v, bias, mask.to("cuda"), grad, torch.bfloat16,
                                     f"(dead key blocks, D={D}, seed {seed})")
    for name in ("dk", "dv"):
        assert (ours[name][..., 128:256, :] == 0).all(), f"{name} of masked keys is not zero"
    for name in ("o", "dq", "dk", "dv"):
        assert (ours[name][0, 2] == 0).all() and (ours[name][1, 6] == 0).all(), name
    assert (ours["dbias"][..., 128:256] == 0).all(), "dbias of keys no slice attends to"


def check_fp64_and_repeatable(q, k, v, bias, mask, grad, dtype, context,
                              baseline=triangle_attention_torch):
    """Within the FP64 rule against `baseline` (a poisoned allocator first) and bitwise
    reproducible (O and the gradients); returns our outputs."""
    D = q.shape[-1]
    ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(D))
    poison_allocator()
    ours = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    base = run_with_grads(baseline, q, k, v, bias, mask, grad)
    check_fa3_rule(ours, base, ref, dtype, context)
    again = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    for name in ("o",) + tuple(GRADS):
        assert torch.equal(ours[name], again[name]), f"{name} differs between calls {context}"
    return ours


def test_residual_lowers_gradient_error(seed):
    sq = residual_squared_errors(64, 128, "cuda", torch.Generator().manual_seed(seed))
    red = {n: 1 - math.sqrt(x / y) for n, (x, y, _) in sq.items()}
    print("GPU residual error reduction:", {n: f"{100 * r:.1f}%" for n, r in red.items()})
    for name in ("dq", "dk", "dbias"):
        assert red[name] > 0, (name, red)


def test_strided_query_rows(seed):
    """The kernels take strides: a range of query rows with the matching bias rows."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(2, 5, 2, 90, 32, torch.bfloat16, "cuda", g)
    B, N, H, S, _ = q.shape
    full = tpf.triangle_attention(q, k, v, bias, mask)
    rows = slice(17, 71)
    part = tpf.triangle_attention_rows(q[:, :, :, rows], k, v, bias.reshape(B, H, S, S)[:, :, rows],
                                       mask.reshape(B, N, S))
    assert torch.equal(part, full[:, :, :, rows])


def test_cuda_graph_capture(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(1, 8, 4, 64, 32, torch.bfloat16, "cuda", g)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up on the side stream before capture
            tpf.triangle_attention(*leaves, mask).backward(grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        out = tpf.triangle_attention(*leaves, mask)
        out.backward(grad)
    graph.replay()
    torch.cuda.synchronize()
    eager = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    assert torch.equal(out, eager["o"])
    for t, name in zip(leaves, GRADS):
        assert torch.equal(t.grad, eager[name]), name


def test_float32_cuda_inputs_fall_back_to_torch_math(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, grad = make_case(1, 4, 2, 20, 16, torch.float32, "cuda", g)
    out = tpf.triangle_attention(q, k, v, bias, mask)
    assert torch.allclose(out, triangle_attention_torch(q, k, v, bias, mask))


def test_float32_bias_with_gradient_takes_any_strides(seed):
    """Protenix's bias: float32, [B, 1, H, S, S] permuted from [B, S, S, H] (stride H in the key
    dimension), with 16-bit q, k, v and a gradient to come: the same results as a contiguous copy."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, _, mask, grad = make_case(1, 3, 4, 40, 32, torch.bfloat16, "cuda", g)
    bias = torch.randn(1, 40, 40, 4, generator=g).cuda().permute(0, 3, 1, 2)[:, None]
    assert bias.stride(-1) == 4
    strided = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad)
    dense = run_with_grads(tpf.triangle_attention, q, k, v, bias.contiguous(), mask, grad)
    for name in ("o", *GRADS):
        assert torch.equal(strided[name], dense[name]), name


def test_unsupported_head_dim_is_a_clear_error(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 2, 1, 8, 20, torch.bfloat16, "cuda", g)
    with pytest.raises(ValueError, match="head dims"):
        tpf.triangle_attention(q, k, v, bias, mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [8, 24, 40, 48, 56, 72, 96, 128])
@pytest.mark.parametrize("S", [33, 200])
def test_unbuilt_and_wide_head_dims_match_fp64_reference(S, D, dtype, seed):
    """Head dims the backward runs as the next built one (16, 32, 64, 128) with zero-padded tiles,
    and D 72-128 on the split-D tiles (both consumer warpgroups on the same 64 keys, each with half
    of dK, dV and dQ's columns; backward_sm90_tiles.h): O and every gradient within the FP64 rule,
    bitwise repeatable, a fully masked slice zero (a store past the tensors' D would land in the
    next row and show in the comparison)."""
    g = torch.Generator().manual_seed(seed)
    B, N = 2, 6
    q, k, v, bias, mask, grad = make_case(B, N, 4, S, D, dtype, "cuda", g)
    ours = check_fp64_and_repeatable(q, k, v, bias, mask, grad, dtype,
                                     f"(D={D}, S={S}, {dtype}, seed {seed})")
    for name in ("o", "dq", "dk", "dv"):
        assert (ours[name][-1, N - 1] == 0).all(), f"{name} of the fully masked slice is not zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32, 64, 96, 128])
@pytest.mark.parametrize("S", [100, 257])
def test_float32_bias_backward_matches_fp64_reference(S, D, dtype, seed):
    """A float32 bias with 16-bit q, k, v (Protenix passes bias.float()) through the CUDA backward:
    read as float32 (values q's dtype cannot hold), O and every gradient within the FP64 rule
    (baseline: PyTorch with the bias rounded to q's dtype), dbias returned in float32 and closer
    to FP64 than ours from the rounded bias, bitwise repeatable, a fully masked slice zero."""
    g = torch.Generator().manual_seed(seed)
    B, N = 2, 9
    q, k, v, bias, mask, grad = make_case(B, N, 4, S, D, dtype, "cuda", g)
    bias = bias.float() * 8 + torch.rand(bias.shape, generator=g).to(bias.device) * 1e-2
    assert not torch.equal(bias, bias.to(dtype).float())
    context = f"(float32 bias, S={S}, D={D}, {dtype}, seed {seed})"
    ours = check_fp64_and_repeatable(
        q, k, v, bias, mask, grad, dtype, context,
        baseline=lambda q, k, v, b, m: triangle_attention_torch(q, k, v, b.to(dtype), m))
    assert ours["dbias"].dtype == torch.float32 and ours["dq"].dtype == dtype
    # Read unrounded: our own dbias from the bias rounded to q's dtype is farther from this FP64
    # one. (Not below FP64 rounded to bf16: dS carries the forward's P rounding through delta,
    # ~0.2 % relative L2 on these peaked rows, which a bf16 dbias hid.)
    ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(D))["dbias"]
    rounded = run_with_grads(tpf.triangle_attention, q, k, v, bias.to(dtype), mask, grad)

    def rel_l2(x):
        return ((x.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel_l2(ours["dbias"]) < rel_l2(rounded["dbias"]), context
    for name in ("o", "dq", "dk", "dv"):
        assert (ours[name][-1, N - 1] == 0).all(), f"{name} of the fully masked slice {context}"


def test_bad_input_names_the_argument_on_cuda():
    """Every bad input of the CPU test (attention_cases.BAD_INPUTS) raises the same message on
    CUDA (bfloat16 and float16, a gradient to come), before any launch. Run in a child process
    (attention_bad_inputs.py), so that an input that crashes the process fails this test instead
    of ending the run; the child prints each case before it runs it."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(here, "..", "python"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(here, "attention_bad_inputs.py")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, (f"the child process ended with {run.returncode} after\n"
                                 f"{run.stdout[-600:]}\n{run.stderr[-3000:]}")
    rows = json.loads(run.stdout.split("ROWS", 1)[1])
    assert len(rows) == 2 * len(BAD_INPUTS)
    for dtype, i, message, got in rows:
        assert got is not None and message in got, (dtype, i, message, got)


FRESH_THREADS = """
import threading, torch, tpfkit as tpf
def leaves(D):
    g = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    return g(1, 2, 4, 100, D), g(1, 2, 4, 100, D), g(1, 2, 4, 100, D), g(1, 1, 4, 100, 100)
q, k, v, bias = leaves(32)
o = tpf.triangle_attention(q, k, v, bias)
o.backward(torch.randn_like(o))  # autograd's own thread: its first CUDA work is our backward
errors = []
def step(D):
    try:
        x = leaves(D)
        tpf.triangle_attention(*x).float().square().sum().backward()
    except Exception as e:
        errors.append(repr(e))
for D in (16, 64):  # a new Python thread each: forward and backward from there
    t = threading.Thread(target=step, args=(D,))
    t.start()
    t.join()
assert not errors, errors
print("FRESH_OK")
"""


def test_first_call_on_a_fresh_thread():
    """The first forward and backward of a process, and of a new thread: the TMA maps are encoded
    by a driver call, which needs the thread's context current (2026-12-07: the first backward of
    every process failed with cuTensorMapEncodeTiled error 201 on autograd's thread)."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(here, "..", "python"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", FRESH_THREADS], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0 and "FRESH_OK" in run.stdout, run.stderr[-3000:]


# ---- the Hopper forward (forward_sm90.cu): every head dim it takes, forward only ----------------
# (The backward takes D = 16, 32, 64; the tests above run both at those.)

FWD_DIMS = [8, 16, 24, 32]


def forward_op(q, k, v, bias, mask, scale, keep_residual=True):
    """The forward op alone (O, lse, residual), into a poisoned allocator."""
    B, N, H, Sq, D = q.shape
    Sk = k.shape[3]
    poison_allocator()
    o, lse, res = torch.ops.tpfkit.triangle_attention_fwd(
        q, k, v, bias.reshape(B, H, Sq, Sk), None if mask is None else mask.reshape(B, N, Sk),
        scale, keep_residual)
    torch.cuda.synchronize()
    return o, lse, res


def forward_fp64(q, k, v, bias, mask, scale):
    B, N, H, Sq, D = q.shape
    Sk = k.shape[3]
    cpu = [t.detach().cpu() for t in (q, k, v, bias)]
    o = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty((B, N, H, Sq), dtype=torch.float64)
    tpf._C.attention_forward_reference(
        cpu[0], cpu[1], cpu[2], cpu[3].reshape(B, H, Sq, Sk),
        None if mask is None else mask.detach().cpu().reshape(B, N, Sk), o, lse, scale)
    return o, lse


def lse_error_bound(q, k, bias, scale, ref_lse):
    """First-order bound on |lse - lse_FP64| of the Hopper forward, whose lse is
    m |scale| + ln(l) with l the fp32 sum of the fp32 P (no rounding to q's dtype); u = 2^-24 and
    A = max |bias| + |scale| max_{q,k} sum_i |q_i k_i| (finite bias entries) bounds every
    |scale x score| and so the row maxima, T = ceil(Sk / 64) key tiles, L = max |lse|:
      - exp2: 2.7e-6 relative per P (the FMA-pipe polynomial's 2.64e-6; the MUFU's is smaller);
      - l: every P passes 3 tree additions in its tile, <= T additions into l, 2 over the quad;
      - rescales: at most one per key tile (the forward rescales whenever a row's maximum grows,
        kRescaleLog2 = 0), so <= T of them, each a MUFU factor (< 2^-21) and a product (u), their
        arguments adding <= 2 A u in all;
      - scores: the pre-scaled bias (2 roundings), ceil(D / 16) MMA k-steps: (ceil(D/16) + 3) A u;
      - exponent arguments x = acc c - m c (c = |scale| log2 e rounded, m c rounded, the FMA):
        <= 5 A u in ln units;
      - the lse itself: m |scale| (A u), logf (1 ulp of ln l <= ln(Sk 2^8)), the sum (L u)."""
    D, Sk = q.shape[-1], k.shape[-2]
    with torch.no_grad():
        b = bias.double().abs()
        b_max = b[torch.isfinite(b)].max().item() if torch.isfinite(b).any() else 0.0
        qk = torch.matmul(q.abs().float(), k.abs().float().transpose(-1, -2)).max().item()
    A = b_max + abs(scale) * qk * (1 + 1e-5)
    T = -(-Sk // 64)
    L = ref_lse[torch.isfinite(ref_lse)].abs().max().item() if torch.isfinite(ref_lse).any() else 0
    u = 2.0**-24
    rescales = T
    return (2.7e-6 + rescales * (2.0**-21 + u) +
            u * (3 + T + 2 + 2 * A + (-(-D // 16) + 3) * A + 5 * A + A +
                 2 * math.log(Sk * 256) + L))


def check_forward(q, k, v, bias, mask, scale, dtype, context, baseline=triangle_attention_torch):
    """O within the suite's accuracy rule against FP64 (baseline: PyTorch in the input dtype), O +
    residual at least as close as O, the lse within its error model where finite and +inf exactly
    where the reference has no finite score; bitwise reproducible. Returns (o, lse).
    The lse's model: fp32 throughout (lse_error_bound); nothing of P's rounding to q's dtype
    enters it, since the forward sums the fp32 P for l."""
    o, lse, res = forward_op(q, k, v, bias, mask, scale)
    ref_o, ref_lse = forward_fp64(q, k, v, bias, mask, scale)
    with torch.no_grad():
        base = baseline(q, k, v, bias, mask, scale) if baseline is triangle_attention_torch else \
            baseline(q, k, v, bias, mask)
    assert_accurate("o", o, base, ref_o, roundings=ROUNDINGS_16BIT["o"], dtype=dtype,
                    context=context)
    err = max_err(o, ref_o)
    exact = o.double().cpu() + res.double().cpu()
    assert (exact - ref_o).abs().max() <= err + 1e-6, f"O + residual is farther than O {context}"
    lse_c = lse.double().cpu()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse_c), finite), f"rows without a finite score differ {context}"
    assert (lse_c[~finite] == float("inf")).all(), context
    lse_bound = lse_error_bound(q, k, bias, scale, ref_lse)
    lse_err = (lse_c[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_err <= lse_bound, f"lse: {lse_err:.3e} > {lse_bound:.3e} {context}"
    again = forward_op(q, k, v, bias, mask, scale)
    for name, x, y in zip(("o", "lse", "residual"), (o, lse, res), again):
        assert torch.equal(x, y), f"{name} differs between calls {context}"
    return o, lse



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", FWD_DIMS)
@pytest.mark.parametrize("S", [1, 33, 100, 257, 384])
def test_forward_matches_fp64_reference(S, D, dtype, seed):
    """B = 2, N = 23 (the last slice group of 4 is partial), random masks, the last slice fully
    masked: 1 to 6 key tiles, 1 to 3 query blocks."""
    g = torch.Generator().manual_seed(seed)
    N = min(S, 23)
    q, k, v, bias, mask, _ = make_case(2, N, 4, S, D, dtype, "cuda", g)
    o, lse = check_forward(q, k, v, bias, mask, 1 / math.sqrt(D), dtype,
                           f"(S={S}, D={D}, {dtype}, seed {seed})")
    assert (o[-1, N - 1] == 0).all() and (lse[-1, N - 1] == float("inf")).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", list(range(40, 129, 8)))
@pytest.mark.parametrize("S", [1, 33, 100, 257, 384])
def test_forward_wide_head_dims(S, D, dtype, seed):
    """Every head dim past 32 (multiples of 8 to 128): two slices per CTA up to 64, one above; K
    and V in 2 to 8 swizzled blocks per tile (D = 40: padded to 48, three 16-wide blocks)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(2, 5, 2, S, D, dtype, "cuda", g)
    check_forward(q, k, v, bias, mask, 1 / math.sqrt(D), dtype, f"(S={S}, D={D}, {dtype})")


def whole_slice_mask(B, N, S, g):
    """Key masks [B, N, 1, 1, S] of padded crops: in batch 0 the slices past a length L are fully
    masked (so slice groups of 4 are fully, partly or not masked) and keys past L masked in the
    others; batch 1 mixes whole 64-key tiles with partial ones (mixed_tile_mask)."""
    mask = torch.ones(B, N, 1, 1, S, dtype=torch.bool)
    L = max(1, (2 * N) // 3)
    mask[0, L:] = False
    mask[0, :, ..., min(S, L * S // N + 1):] = False
    mask[1:] = mixed_tile_mask(B - 1, N, S, g)
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32])
@pytest.mark.parametrize("S,N", [(64, 9), (200, 13), (300, 11)])
def test_forward_whole_masked_slices_and_tiles(S, N, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, _, _ = make_case(2, N, 4, S, D, dtype, "cuda", g)
    mask = whole_slice_mask(2, N, S, g).to("cuda")
    o, lse = check_forward(q, k, v, bias, mask, 1 / math.sqrt(D), dtype,
                           f"(S={S}, N={N}, D={D}, {dtype}, seed {seed})")
    dead = ~mask.reshape(2, N, S).any(-1)
    assert (o[dead] == 0).all() and (lse[dead] == float("inf")).all()


@pytest.mark.parametrize("D", [16, 32])
def test_forward_without_mask_and_negative_scale(D, seed):
    """mask=None (every key tile whole but the tail) and a negative scale (Q's sign flipped)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, _, _ = make_case(2, 6, 4, 150, D, torch.bfloat16, "cuda", g)
    for scale in (1 / math.sqrt(D), -0.7 / math.sqrt(D)):
        check_forward(q, k, v, bias, None, scale, torch.bfloat16, f"(D={D}, scale {scale})")


@pytest.mark.parametrize("D", [16, 32])
@pytest.mark.parametrize("kind", ["first-key-tile", "every-key"])
def test_forward_minus_infinity_in_the_bias(kind, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(2, 5, 4, 150, D, torch.float16, "cuda", g)
    bias = with_minus_inf_bias(bias, kind)
    check_forward(q, k, v, bias, mask, 1 / math.sqrt(D), torch.float16, f"({kind}, D={D})",
                  baseline=attention_finite_rows_torch)


@pytest.mark.parametrize("D", [16, 24, 32])
def test_forward_strided_inputs(D, seed):
    """q, k, v as models produce them: permuted views of [B, N, S, H, D] (slice and batch
    strides merge), of a [B, S, N, H, D] transpose (head and slice strides merge, batch apart),
    of a fused [.., 3, H, D] projection; a bias with padded rows; k misaligned (copied by the
    op). Each bitwise equal to the contiguous inputs' result."""
    g = torch.Generator().manual_seed(seed)
    B, N, H, S = 2, 7, 3, 90
    q, k, v, bias, mask, _ = make_case(B, N, H, S, D, torch.bfloat16, "cuda", g)
    scale = 1 / math.sqrt(D)
    want = forward_op(q, k, v, bias, mask, scale)
    views = {
        "bnshd": lambda x: x.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4),
        "bsnhd": lambda x: x.permute(0, 3, 1, 2, 4).contiguous().permute(0, 2, 3, 1, 4),
        "fused": lambda x: torch.stack([x.permute(0, 1, 3, 2, 4)] * 3, 3).permute(0, 1, 4, 2, 3, 5)[:, :, :, :, 1],
    }
    for name, view in views.items():
        qs, ks, vs = view(q), view(k), view(v)
        assert torch.equal(qs, q) and not qs.is_contiguous(), name
        got = forward_op(qs, ks, vs, bias, mask, scale)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"{name}: differs from the contiguous inputs"
    wide = torch.zeros(B, H, S, S + 5, dtype=bias.dtype, device="cuda")
    wide[..., :S] = bias.reshape(B, H, S, S)
    got = forward_op(q, k, v, wide[..., :S], mask, scale)
    assert torch.equal(got[0], want[0]), "strided bias"
    padded = torch.zeros(B, N, H, S, D + 1, dtype=k.dtype, device="cuda")
    padded[..., 1:] = k
    out = tpf.triangle_attention(q, padded[..., 1:], v, bias, mask)
    assert torch.equal(out, want[0]), "misaligned k"


def test_forward_without_saved_state_matches(seed):
    """No residual kept (residual=False, or no gradient needed): the same O."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 5, 2, 100, 32, torch.bfloat16, "cuda", g)
    o, _, _ = forward_op(q, k, v, bias, mask, 1 / math.sqrt(32))
    o2, _, res = forward_op(q, k, v, bias, mask, 1 / math.sqrt(32), keep_residual=False)
    assert res.numel() == 0 and torch.equal(o, o2)
    with torch.no_grad():
        assert torch.equal(tpf.triangle_attention(q, k, v, bias, mask), o)


@pytest.mark.parametrize("D", [16, 32])
def test_forward_bitwise_repeatable(D, seed):
    """O, lse and residual bitwise identical over 5 calls, on 20 random inputs."""
    g = torch.Generator().manual_seed(seed)
    for case in range(20):
        q, k, v, bias, mask, _ = make_case(1, 9, 4, 257, D, torch.bfloat16, "cuda", g)
        first = forward_op(q, k, v, bias, mask, 1 / math.sqrt(D))
        for _ in range(4):
            for a, b in zip(first, forward_op(q, k, v, bias, mask, 1 / math.sqrt(D))):
                assert torch.equal(a, b), f"input {case}"


def test_forward_cuda_graph_capture(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(2, 9, 4, 200, 16, torch.bfloat16, "cuda", g)
    eager = tpf.triangle_attention(q, k, v, bias, mask)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tpf.triangle_attention(q, k, v, bias, mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tpf.triangle_attention(q, k, v, bias, mask)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32])
def test_forward_float32_bias(D, dtype, seed):
    """A float32 bias is read as float32: within the FP64 rule, and closer to FP64 than the same
    bias rounded to q's dtype (spread 8, where that rounding moves scores by up to 8 x 2^-9)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(2, 7, 4, 200, D, dtype, "cuda", g)
    # Values that q's dtype cannot hold (bias.float() * 8 alone is exact in it: the rounded bias
    # would be the same bias, as it was here until 2026-12-02).
    bias = bias.float() * 8 + torch.rand(bias.shape, generator=g).to(bias.device) * 1e-2
    assert not torch.equal(bias, bias.to(dtype).float())
    scale = 1 / math.sqrt(D)
    rounded = bias.to(dtype)
    check_forward(q, k, v, bias, mask, scale, dtype, f"(float32 bias, D={D}, {dtype})",
                  baseline=lambda q, k, v, b, m: triangle_attention_torch(q, k, v, rounded, m, scale))
    ref_o, _ = forward_fp64(q, k, v, bias, mask, scale)
    # O before its rounding to q's dtype (O + residual): the rounded O's largest error is its
    # output rounding, which both biases can share at the same element.
    o32 = [x.double() for x in forward_op(q, k, v, bias, mask, scale)[::2]]
    o16 = [x.double() for x in forward_op(q, k, v, rounded, mask, scale)[::2]]
    assert max_err(sum(o32), ref_o) < max_err(sum(o16), ref_o)
