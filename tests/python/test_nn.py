"""The nn modules: `turbo` against `reference` by FlashAttention-3's rule, forward and every gradient.

For each output and gradient: |turbo - fp64| <= 2 |reference - fp64| + rounding noise, where turbo and
reference run in the same precision and fp64 is the reference module in float64.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tpfkit.nn import (
    AttentionPairBias,
    PairFormer,
    PairFormerBlock,
    Transition,
    TriangleAttention,
    TriangleMultiplication,
    set_backend,
)
from tpfkit.ops.torch_reference import triangle_multiplicative_update_torch

from accuracy import assert_accurate, gradient_scale, gradient_terms


def randomize(module: torch.nn.Module, gen: torch.Generator) -> torch.nn.Module:
    """Random weights everywhere: AlphaFold3's zero-initialized output layers would make both
    backends trivially agree on zeros."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            elif name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)
    return module


def masks(B: int, S: int, gen: torch.Generator):
    """Token mask with a padded tail in the last sample (rows whose keys are all masked)."""
    token = torch.ones(B, S, dtype=torch.bool)
    if B > 1 and S > 2:
        token[-1, S - int(torch.randint(1, S // 2 + 1, (1,), generator=gen)):] = False
    return token, token[:, :, None] & token[:, None, :]


def assert_fa3(name: str, out: torch.Tensor, base: torch.Tensor, ref64: torch.Tensor, seed: int,
               roundings: int, scale: float | None = None, terms: int = 1):
    assert_accurate(name, out, base, ref64, roundings=roundings, scale=scale, terms=terms,
                    context=f"seed {seed}")


def run(module, inputs, backend: str, dtype: torch.dtype, grad_out, call):
    """Outputs and gradients (inputs and parameters) of call(module, *inputs) in dtype."""
    m = set_backend(copy.deepcopy(module), backend).to(dtype)
    xs = [x.detach().to(dtype).requires_grad_(True) if x.is_floating_point() else x
          for x in inputs]
    outs = call(m, *xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o in outs if o is not None],
                            [g.to(dtype) for g, o in zip(grad_out, outs) if o is not None])
    grads = {f"d{i}": x.grad for i, x in enumerate(xs) if x.is_floating_point()}
    grads.update({f"d[{n}]": p.grad for n, p in m.named_parameters()})
    return [o for o in outs if o is not None], grads


def check_backends_agree(module, inputs, call, dtype, seed, roundings: dict,
                         parameter_grads: bool = True):
    """`roundings` (by dtype, MODULE_ROUNDINGS): the longest chain of values the turbo design
    rounds to `dtype` between an input and an output (accuracy.py). parameter_grads=False for a composition of modules (a
    block, a stack): its outputs and input gradients are held to the rule, while its parameter
    gradients, each downstream of several ops' rounding, are held to it in the test of the module
    that owns them."""
    grad_roundings = roundings[torch.float32] if dtype == torch.float32 else \
        roundings["16-bit gradients"]
    roundings = roundings[torch.float32 if dtype == torch.float32 else "16-bit"]
    # The FP64 results are of the module and inputs as the backends see them, rounded to dtype (as
    # FlashAttention-3 measures): the rounding of the inputs is not the computation's error, and
    # how far it moves the result depends on the conditioning of each input, which the
    # backends' errors then share only in part (S = 1 in 16-bit: up to 17 roundings' worth).
    module = copy.deepcopy(module).to(dtype).double()
    inputs = [x.to(dtype).double() if x.is_floating_point() else x for x in inputs]
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        shapes = call(set_backend(copy.deepcopy(module), "reference"), *inputs)
    shapes = shapes if isinstance(shapes, tuple) else (shapes,)
    grad_out = [None if o is None else
                torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).double()
                for o in shapes]
    with gradient_terms(module) as terms:
        out64, g64 = run(module, inputs, "reference", torch.float64, grad_out, call)
    out_ref, g_ref = run(module, inputs, "reference", dtype, grad_out, call)
    # The baseline's error measured twice: the batch in reverse order rounds every sum over the
    # batch (the parameter gradients) differently with the same exact value, and the larger error
    # counts. The parameter gradients of both backends are sums computed by the same PyTorch ops,
    # whose errors dominate and vary a lot between two roundings of the same sum.
    flip = lambda t: None if t is None or t.dim() == 0 else t.flip(0)
    out_rev, g_rev = run(module, [flip(x) for x in inputs], "reference", dtype,
                         [flip(g) for g in grad_out], call)
    out_rev = [flip(o) for o in out_rev]
    g_rev = {k: (flip(v) if not k.startswith("d[") else v) for k, v in g_rev.items()}
    out_turbo, g_turbo = run(module, inputs, "turbo", dtype, grad_out, call)
    for i, (o, b, b2, r) in enumerate(zip(out_turbo, out_ref, out_rev, out64)):
        assert_fa3(f"output {i}", o, [b, b2], r, seed, roundings)
    assert set(g_turbo) == set(g64)
    # Each sample's own contribution to the parameter gradients (samples do not interact): the
    # batch sum rounds at their magnitude, which cancellation between them can hide (S = 1: each
    # parameter gradient is the sum of two terms, one per sample).
    per_sample = [run(module, [x[b:b + 1] for x in inputs], "reference", torch.float64,
                      [None if g is None else g[b:b + 1] for g in grad_out], call)[1]
                  for b in range(inputs[0].shape[0])] if parameter_grads else []
    for name in g64:
        if not parameter_grads and name.startswith("d["):
            continue
        if g64[name] is None:
            assert g_turbo[name] is None and g_ref[name] is None, name
            continue
        scale, count = gradient_scale(name, g64, per_sample, terms)
        assert_fa3(f"gradient {name}", g_turbo[name], [g_ref[name], g_rev[name]], g64[name], seed,
                   grad_roundings, scale, count)


DTYPES = [torch.float32, torch.bfloat16]
SIZES = [1, 7, 33]


# Roundings on the longest chain the turbo design rounds to the working dtype (accuracy.py). In
# 16-bit dtypes, the stored values: triangle attention and the single track's attention round the
# LayerNorm output, the projections, P, O, the gated output and the output projection (6); trimul is
# one fused op (a or b, z, the gate logits, the output: 4). In float32 every PyTorch op between them
# rounds too: LayerNorm's 8 steps, the projections, our op, the gate's 3, the output projection,
# forward and back (24); trimul's own 25 (trimul_cases). A gradient's chain in 16-bit also runs
# through the backward's stored values: attention's dS (16-bit for the tensor cores), the op's
# dq/dk/dv, the projections' input gradient and the sum of the projections' (+4: 10); trimul's dz
# (for the contraction), da/db and dx (+3: 7).
ATTENTION_ROUNDINGS = {"16-bit": 6, "16-bit gradients": 10, torch.float32: 24}
TRIMUL_ROUNDINGS = {"16-bit": 4, "16-bit gradients": 7, torch.float32: 25}
PAIR_MODULES = {  # the modules that map z [B, S, S, 16] to an update of z
    "tri_att_start": lambda: TriangleAttention(16, 8, 3, starting=True),
    "tri_att_end": lambda: TriangleAttention(16, 8, 3, starting=False),
    "tri_mul_out": lambda: TriangleMultiplication(16, outgoing=True),
    "tri_mul_in": lambda: TriangleMultiplication(16, outgoing=False),
}
PAIR_ROUNDINGS = {"tri_att_start": ATTENTION_ROUNDINGS, "tri_att_end": ATTENTION_ROUNDINGS,
                  "tri_mul_out": TRIMUL_ROUNDINGS, "tri_mul_in": TRIMUL_ROUNDINGS}
# A block adds each module's update to its input: the longest single chain is an attention's.
BLOCK_ROUNDINGS = ATTENTION_ROUNDINGS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S", SIZES)
@pytest.mark.parametrize("name", PAIR_MODULES)
def test_pair_module_backends_agree(name, S, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    module = randomize(PAIR_MODULES[name]().double(), gen)
    z = torch.randn(2, S, S, 16, generator=gen, dtype=torch.float64)
    _, pair_mask = masks(2, S, gen)
    check_backends_agree(module, [z, pair_mask], lambda m, z, pm: m(z, pm), dtype, seed,
                         PAIR_ROUNDINGS[name])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S", SIZES)
def test_attention_pair_bias_backends_agree(S, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    module = randomize(AttentionPairBias(12, 16, 4, 3).double(), gen)
    s = torch.randn(2, S, 12, generator=gen, dtype=torch.float64)
    z = torch.randn(2, S, S, 16, generator=gen, dtype=torch.float64)
    token_mask, _ = masks(2, S, gen)
    check_backends_agree(module, [s, z, token_mask], lambda m, s, z, tm: m(s, z, tm), dtype, seed,
                         ATTENTION_ROUNDINGS)


def trimul_by_loops(x, w, outgoing: bool, mask):
    """AlphaFold3 algorithms 12 and 13 with the triangle contraction written as loops over (i, j)."""
    ln = torch.nn.functional.layer_norm
    D = x.shape[-1]
    x = ln(x, (D,), w["norm_in_weight"], w["norm_in_bias"])
    p = x @ w["p_in_weight"].T
    g = torch.sigmoid(x @ w["g_in_weight"].T)
    ab = p * g * mask[..., None]
    a, b = ab[..., :D], ab[..., D:]
    B, S = x.shape[:2]
    z = torch.zeros_like(x)
    for i in range(S):
        for j in range(S):
            if outgoing:    # edges i->k and j->k
                z[:, i, j] = (a[:, i, :] * b[:, j, :]).sum(1)
            else:           # edges k->i and k->j
                z[:, i, j] = (a[:, :, i] * b[:, :, j]).sum(1)
    z = ln(z, (D,), w["norm_out_weight"], w["norm_out_bias"])
    return torch.sigmoid(x @ w["g_out_weight"].T) * (z @ w["p_out_weight"].T)


@pytest.mark.parametrize("S", [1, 7, 12])
@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_triangle_multiplication_reference_matches_loops(outgoing, S, seed):
    gen = torch.Generator().manual_seed(seed)
    module = randomize(TriangleMultiplication(8, outgoing=outgoing).double(), gen)
    x = torch.randn(2, S, S, 8, generator=gen, dtype=torch.float64)
    _, pair_mask = masks(2, S, gen)
    w = {"norm_in_weight": module.layer_norm_in.weight, "norm_in_bias": module.layer_norm_in.bias,
         "p_in_weight": torch.cat([module.linear_a_p.weight, module.linear_b_p.weight]),
         "g_in_weight": torch.cat([module.linear_a_g.weight, module.linear_b_g.weight]),
         "norm_out_weight": module.layer_norm_out.weight,
         "norm_out_bias": module.layer_norm_out.bias,
         "p_out_weight": module.linear_z.weight, "g_out_weight": module.linear_g.weight}
    with torch.no_grad():
        expected = trimul_by_loops(x, w, outgoing, pair_mask.double())
        got = module(x, pair_mask)
        direct = triangle_multiplicative_update_torch(
            x, "outgoing" if outgoing else "incoming", pair_mask, **w)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=f"seed {seed}")
    torch.testing.assert_close(direct, expected, rtol=1e-10, atol=1e-10, msg=f"seed {seed}")


def test_transition_masks_rows_and_matches_swiglu(seed):
    gen = torch.Generator().manual_seed(seed)
    module = randomize(Transition(6, n=3).double(), gen)
    x = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, False, False, True]])
    h = torch.nn.functional.layer_norm(x, (6,), module.layer_norm.weight, module.layer_norm.bias)
    a, b = module.swiglu.linear_a, module.swiglu.linear_b
    expected = (torch.nn.functional.silu(h @ a.weight.T) * (h @ b.weight.T)) @ module.linear_out.weight.T
    expected = expected * mask[..., None]
    with torch.no_grad():
        torch.testing.assert_close(module(x, mask), expected, msg=f"seed {seed}")


@pytest.mark.parametrize("S", [5, 19])
def test_pairformer_block_backends_agree(S, seed):
    gen = torch.Generator().manual_seed(seed)
    module = randomize(PairFormerBlock(16, c_s=8, c_hidden_pair_att=8, no_heads_pair=2,
                                       c_hidden_pair_bias=4, no_heads_pair_bias=2,
                                       transition_n=2).double(), gen)
    s = torch.randn(2, S, 8, generator=gen, dtype=torch.float64)
    z = torch.randn(2, S, S, 16, generator=gen, dtype=torch.float64)
    token_mask, pair_mask = masks(2, S, gen)
    check_backends_agree(module, [s, z, token_mask, pair_mask],
                         lambda m, s, z, tm, pm: m(s, z, tm, pm), torch.float32, seed,
                         BLOCK_ROUNDINGS, parameter_grads=False)


def test_pairformer_stack_backends_agree_with_checkpointing(seed):
    gen = torch.Generator().manual_seed(seed)
    module = randomize(PairFormer(2, 16, c_hidden_pair_att=8, no_heads_pair=2, transition_n=2,
                                  checkpoint=True).double(), gen)
    z = torch.randn(2, 11, 11, 16, generator=gen, dtype=torch.float64)
    _, pair_mask = masks(2, 11, gen)
    check_backends_agree(module, [z, pair_mask], lambda m, z, pm: m(None, z, None, pm)[1],
                         torch.float32, seed, BLOCK_ROUNDINGS, parameter_grads=False)


def test_turbo_block_compiles_whole_and_matches_eager(seed):
    """A turbo PairFormer block under torch.compile(fullgraph=True): our ops stay custom ops in one
    graph (no graph break), and output and gradients are as accurate as the eager block's (FP32,
    CPU; by the suite's rule against the block in float64, with the eager turbo and reference
    blocks as baselines: Inductor rounds the glue around our ops in its own order)."""
    gen = torch.Generator().manual_seed(seed)
    block = randomize(PairFormerBlock(16, c_s=8, c_hidden_pair_att=8, no_heads_pair=2,
                                      c_hidden_pair_bias=4, no_heads_pair_bias=2, transition_n=2,
                                      backend="turbo").double(), gen)
    s = torch.randn(1, 9, 8, generator=gen, dtype=torch.float64)
    z = torch.randn(1, 9, 9, 16, generator=gen, dtype=torch.float64)
    token_mask, pair_mask = masks(1, 9, gen)

    def run(module, dtype):
        module = module.to(dtype)
        zi = z.detach().to(dtype).clone().requires_grad_(True)
        s_out, z_out = module(s.to(dtype), zi, token_mask, pair_mask)
        (z_out.square().sum() + s_out.square().sum()).backward()
        return {"z": z_out.detach(), "dz": zi.grad,
                **{n.replace("_orig_mod.", ""): p.grad for n, p in module.named_parameters()}}

    ref = run(set_backend(copy.deepcopy(block), "reference"), torch.float64)
    eager = run(copy.deepcopy(block), torch.float32)
    reference = run(set_backend(copy.deepcopy(block), "reference"), torch.float32)
    compiled = run(torch.compile(copy.deepcopy(block).float(), fullgraph=True), torch.float32)
    assert set(compiled) == set(ref)
    grads = {name: g for name, g in ref.items() if name != "z"}
    for name in ref:
        if ref[name] is None:
            assert compiled[name] is None and eager[name] is None, name
            continue
        scale, terms = gradient_scale(name, grads, []) if name != "z" else (None, 1)
        assert_accurate(f"d{name}" if name != "z" else name, compiled[name],
                        [eager[name], reference[name]], ref[name],
                        roundings=BLOCK_ROUNDINGS[torch.float32], scale=scale, terms=terms,
                        context=f"seed {seed}")


def test_backend_and_shape_errors():
    with pytest.raises(ValueError, match="backend must be one of"):
        TriangleAttention(8, 4, 2, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        set_backend(PairFormer(1, 8, c_hidden_pair_att=4, no_heads_pair=2), "fast")
    with pytest.raises(ValueError, match="no_blocks must be >= 1"):
        PairFormer(0, 8)
    block = PairFormerBlock(8, c_s=4, c_hidden_pair_att=4, no_heads_pair=2, c_hidden_pair_bias=2,
                            no_heads_pair_bias=2)
    with pytest.raises(ValueError, match="s must be"):
        block(None, torch.zeros(1, 3, 3, 8))


def test_parameter_names_follow_openfold3():
    names = set(dict(PairFormer(1, 8, c_s=4, c_hidden_pair_att=4, no_heads_pair=2,
                                c_hidden_pair_bias=2, no_heads_pair_bias=2).named_parameters()))
    for expected in ("blocks.0.pair_stack.tri_mul_out.linear_a_p.weight",
                     "blocks.0.pair_stack.tri_mul_in.layer_norm_out.bias",
                     "blocks.0.pair_stack.tri_att_start.mha.linear_q.weight",
                     "blocks.0.pair_stack.tri_att_end.linear_z.weight",
                     "blocks.0.pair_stack.pair_transition.swiglu.linear_a.weight",
                     "blocks.0.attn_pair_bias.layer_norm_z.weight",
                     "blocks.0.attn_pair_bias.mha.linear_q.bias",
                     "blocks.0.single_transition.linear_out.weight"):
        assert expected in names, expected


def test_turbo_backend_runs_our_ops_and_reference_does_not(monkeypatch):
    import tpfkit.nn.attention as attention_module
    import tpfkit.nn.trimul as trimul_module

    calls = {"attention": 0, "trimul": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(attention_module, "triangle_attention",
                        counted("attention", attention_module.triangle_attention))
    monkeypatch.setattr(trimul_module, "triangle_multiplicative_update",
                        counted("trimul", trimul_module.triangle_multiplicative_update))
    import tpfkit.ops.glue as glue_module

    calls.update(gate=0, swiglu=0, layer_norm=0)
    monkeypatch.setattr(glue_module, "gated_output", counted("gate", glue_module.gated_output))
    monkeypatch.setattr(glue_module, "swiglu", counted("swiglu", glue_module.swiglu))
    monkeypatch.setattr(glue_module, "layer_norm", counted("layer_norm", glue_module.layer_norm))
    block = PairFormerBlock(8, c_s=4, c_hidden_pair_att=4, no_heads_pair=2, c_hidden_pair_bias=2,
                            no_heads_pair_bias=2)
    s, z = torch.randn(1, 5, 4), torch.randn(1, 5, 5, 8)
    block(s, z)
    assert set(calls.values()) == {0}
    set_backend(block, "turbo")(s, z)
    # triangle attention twice and the single track once; trimul outgoing and incoming; the
    # LayerNorms of both triangle attentions, both transitions and the single track's two; the
    # gates of the three attentions; both transitions' SwiGLU
    assert calls == {"attention": 3, "trimul": 2, "gate": 3, "swiglu": 2, "layer_norm": 6}
    set_backend(block, "turbo", fused_glue=False)(s, z)
    assert calls == {"attention": 6, "trimul": 4, "gate": 3, "swiglu": 2, "layer_norm": 6}
