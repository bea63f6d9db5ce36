"""Triangle attention CUDA kernels against the FP64 reference (FlashAttention-3's rule),
bitwise determinism, the residual's effect, chunked backward, strided inputs, CUDA graphs."""
import math
import os
import subprocess
import sys

import pytest
import torch

import turbopairformer as tpf
from turbopairformer.ops.torch_reference import triangle_attention_torch

from attention_cases import (GRADS, attention_finite_rows_torch, check_fa3_rule, make_case,
                             reference_fp64, run_with_grads, with_minus_inf_bias)
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


def test_workspace_budget_sets_the_chunks():
    """The budget variable the chunked test relies on changes the workspace the op asks for (so
    the test above does run many launches)."""
    import turbopairformer._C as C
    big = C.attention_backward_workspace_bytes(1, 37, 2, 200, 200, 32, True)
    os.environ["TPF_ATTENTION_DQ_BUDGET_BYTES"] = "1"
    try:
        small = C.attention_backward_workspace_bytes(1, 37, 2, 200, 200, 32, True)
    finally:
        del os.environ["TPF_ATTENTION_DQ_BUDGET_BYTES"]
    assert small < big, (small, big)


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


def check_kernel_variant(monkeypatch, variable, value, S, N, D, seed, label, dtype=torch.bfloat16):
    """Under variable=value: within the FP64 rule with an odd slice count (a half-empty last group),
    B = 2, masked keys and rows, a poisoned allocator, and bitwise reproducible (gradients and O)."""
    monkeypatch.setenv(variable, value)
    g = torch.Generator().manual_seed(seed)
    inputs = make_case(2, N, 4, S, D, dtype, "cuda", g)
    return check_fp64_and_repeatable(*inputs, dtype,
                                     f"({label}, S={S}, N={N}, D={D}, {dtype}, seed {seed})")


@pytest.mark.parametrize("D", [16, 32])
@pytest.mark.parametrize("S,N", [(33, 5), (257, 7)])
def test_uncapped_forward_matches_fp64_reference(monkeypatch, S, N, D, seed):
    """The forward without the 5-blocks-per-SM register cap (TPF_ATTENTION_FWD_BLOCKS=4; the
    default at head dims 16 and 32 is the capped one that every other test runs)."""
    check_kernel_variant(monkeypatch, "TPF_ATTENTION_FWD_BLOCKS", "4", S, N, D, seed, "uncapped forward")


@pytest.mark.parametrize("D", [16, 32])
@pytest.mark.parametrize("masked", [True, False])
def test_four_block_forward_whole_tiles(monkeypatch, D, masked, seed):
    """The 4-block forward on whole key tiles (make_case's masks leave none whole)."""
    monkeypatch.setenv("TPF_ATTENTION_FWD_BLOCKS", "4")
    check_whole_and_masked_tiles(257, D, torch.bfloat16, masked, seed, "4-block forward")


def test_two_row_tile_forward_in_a_subprocess(seed):
    """TPF_ATTENTION_FWD_ROW_TILES=2 (two 64-query row tiles per warp) is read once per process,
    so its tests run in a fresh one: the FP64 rule at S = 257 and the whole/masked tile cases."""
    env = dict(os.environ, TPF_ATTENTION_FWD_ROW_TILES="2", TPF_SEED=str(seed))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "test_matches_fp64_reference and 257 or test_whole_and_masked_key_tiles and 257"],
        env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"MT = 2 forward (seed {seed}):\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


# TPF_ATTENTION_FWD_WGMMA=1: the warpgroup-MMA forward (forward_wgmma.cu).
WGMMA_VERSIONS = ["1"]


@pytest.mark.parametrize("version", WGMMA_VERSIONS)
@pytest.mark.parametrize("D", [16, 32])
@pytest.mark.parametrize("S,N", [(33, 5), (257, 7), (384, 3)])
def test_wgmma_forward_matches_fp64_reference(monkeypatch, S, N, D, version, seed):
    """The warpgroup-MMA forward (TPF_ATTENTION_FWD_WGMMA=1, forward_wgmma.cu); the backward,
    which reads its O, lse and residual, is the default one. The last slice of the second batch is
    fully masked: its O must be zero. 1, 5 and 6 key tiles."""
    ours = check_kernel_variant(monkeypatch, "TPF_ATTENTION_FWD_WGMMA", version, S, N, D, seed,
                                f"wgmma forward {version}")
    assert (ours["o"][-1, N - 1] == 0).all(), "O of the fully masked slice is not zero"


@pytest.mark.parametrize("version", WGMMA_VERSIONS)
@pytest.mark.parametrize("D", [16, 32])
def test_wgmma_forward_float16(monkeypatch, D, version, seed):
    check_kernel_variant(monkeypatch, "TPF_ATTENTION_FWD_WGMMA", version, 257, 7, D, seed,
                         f"wgmma forward {version}", dtype=torch.float16)


def forward_with_residual(q, k, v, bias, mask):
    """The forward op alone (O, lse, residual) on make_case's inputs."""
    B, N, H, S, D = q.shape
    o, lse, res = torch.ops.turbopairformer.triangle_attention_fwd(
        q, k, v, bias.reshape(B, H, S, S), mask.reshape(B, N, S), 1 / math.sqrt(D), True)
    torch.cuda.synchronize()
    return o, lse, res


@pytest.mark.parametrize("version", WGMMA_VERSIONS)
@pytest.mark.parametrize("D", [16, 32])
def test_wgmma_forward_matches_default_forward(monkeypatch, D, version, seed):
    """O and the lse of the wgmma forward against the default forward on the same inputs, with
    residual, at a size with a partial last query and key tile: both round P to bf16 and accumulate
    in fp32, so they agree to a few bf16 ulps (the MMA summation order may differ)."""
    g = torch.Generator().manual_seed(seed)
    inputs = make_case(2, 6, 4, 200, D, torch.bfloat16, "cuda", g)[:5]
    monkeypatch.delenv("TPF_ATTENTION_FWD_WGMMA", raising=False)
    o0, lse0, res0 = forward_with_residual(*inputs)
    monkeypatch.setenv("TPF_ATTENTION_FWD_WGMMA", version)
    o1, lse1, res1 = forward_with_residual(*inputs)
    finite = torch.isfinite(lse0)
    assert torch.equal(finite, torch.isfinite(lse1)), "rows without keys differ"
    assert (lse0[~finite] == lse1[~finite]).all()
    torch.testing.assert_close(lse1[finite], lse0[finite], rtol=0, atol=1e-3)
    exact0 = o0.float() + res0.float()
    exact1 = o1.float() + res1.float()
    torch.testing.assert_close(exact1, exact0, rtol=2e-2, atol=2e-3)


def test_residual_lowers_gradient_error(seed):
    g = torch.Generator().manual_seed(seed)
    sq = {name: [0.0, 0.0] for name in GRADS}
    for _ in range(3):
        q, k, v, bias, mask, grad = make_case(1, 64, 4, 128, 32, torch.bfloat16, "cuda", g)
        ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(32))
        a = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad, residual=True)
        b = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad, residual=False)
        for name in GRADS:
            sq[name][0] += (a[name].double().cpu() - ref[name]).square().sum().item()
            sq[name][1] += (b[name].double().cpu() - ref[name]).square().sum().item()
    red = {n: 1 - math.sqrt(x / y) for n, (x, y) in sq.items()}
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


def test_unsupported_head_dim_is_a_clear_error(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, bias, mask, _ = make_case(1, 2, 1, 8, 24, torch.bfloat16, "cuda", g)
    with pytest.raises(ValueError, match="head dims"):
        tpf.triangle_attention(q, k, v, bias, mask)
