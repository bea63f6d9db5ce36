"""tpfkit.integrations inside the client packages' own PairFormer stacks (CPU).

Each client's stack (small widths, 2 blocks, N = 24 with the last tokens padded) runs forward and
backward on its own PyTorch path and on ours (the integration enabled), in float32 and under bf16
autocast, and both are held against an FP64 run of its PyTorch path by the suite's accuracy rule
(accuracy.py, FlashAttention-3's): s, z, their input gradients and every parameter gradient. The
loss covers real tokens only. Also: ours really run (counted), gradients are bitwise identical over
repeated steps, enable/disable restore the client's modules exactly (state dicts, modules, the
client's packages and its outputs, before enable and after disable), inputs our ops do not take
(float64) run the client's own path with the integration enabled, and a missing call site is an
error naming the installed version. The clients' triangle attention modules and pair transitions
run fused forwards (tpfkit.nn.functional) under the integrations: each is also held alone
against the client's path and FP64 (test_module_matches_fp64_by_accuracy_rule), and the client's
dropout stays where it applies it (test_dropout_as_the_client_applies_it).

boltz-community 2.12.0 installs the same `boltz` package as boltz 2.2.1: scripts/setup puts it in
a folder of its own, and test_boltz_community runs the boltz tests again with it first on the path.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from accuracy import assert_accurate, gradient_scale, gradient_terms
from test_nn import ATTENTION_ROUNDINGS, TRIMUL_ROUNDINGS, randomize
from tpfkit.benchmarks.clients import CLIENTS, MODULES, widths, with_dropout
from tpfkit.integrations import IntegrationError

NAMES = list(CLIENTS)
N, PADDED = 24, 5
BOLTZ_DISTRIBUTION = os.environ.get("TPF_TEST_BOLTZ_DISTRIBUTION", "boltz 2.2.1")
VERSIONS = {"openfold3": "openfold3 0.5.0", "boltz": BOLTZ_DISTRIBUTION,
            "protenix": "protenix 2.0.0"}
# The error model (accuracy.py): our path and the client's PyTorch path differ only in its triangle
# layers (the rest of the stack is the client's code on both), and a block adds each layer's update
# to its input, so the longest chain our design rounds is one triangle layer's: a triangle
# attention's (the client's LayerNorm and projections, our op, its gate and output projection:
# 24 roundings in float32, 6 stored values in bf16) or a triangle multiplication's (our one fused
# op: 25 in float32, 4 stored values in bf16, plus x's rounding to bf16 under autocast: 5), as
# test_nn derives them for our own modules.
ROUNDINGS = {"float32": max(ATTENTION_ROUNDINGS[torch.float32], TRIMUL_ROUNDINGS[torch.float32]),
             "bf16-autocast": max(ATTENTION_ROUNDINGS["16-bit"], TRIMUL_ROUNDINGS["16-bit"] + 1)}
# A gradient's chain also runs through the backward's stored values (test_nn): 10 under autocast.
GRADIENT_ROUNDINGS = {"float32": ROUNDINGS["float32"],
                      "bf16-autocast": max(ATTENTION_ROUNDINGS["16-bit gradients"],
                                           TRIMUL_ROUNDINGS["16-bit gradients"] + 1)}


@pytest.fixture(scope="module", autouse=True)
def protenix_layer_norm():
    # Protenix compiles a CUDA LayerNorm at import unless told to use PyTorch's.
    os.environ.setdefault("LAYERNORM_TYPE", "torch")


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of our two ops made through the integrations, and of our fused glue
    (ops.glue: the LayerNorm, the attention gate, the SwiGLU) made anywhere."""
    counts = {"attention": 0, "trimul": 0, "layer_norm": 0, "gate": 0, "swiglu": 0}
    import tpfkit.integrations.boltz as boltz
    import tpfkit.integrations.openfold3 as openfold3
    import tpfkit.integrations.protenix as protenix
    import tpfkit.ops.glue as glue_ops

    for name, key in (("layer_norm", "layer_norm"), ("gated_output", "gate"),
                      ("swiglu", "swiglu")):
        def counted(*args, _op=getattr(glue_ops, name), _key=key, **kwargs):
            counts[_key] += 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(glue_ops, name, counted)

    for module in (openfold3, boltz, protenix):
        for name, key in (("triangle_attention", "attention"),
                          ("triangle_multiplicative_update", "trimul")):
            op = getattr(module, name)

            def spy(*args, _op=op, _key=key, **kwargs):
                counts[_key] += 1
                return _op(*args, **kwargs)
            monkeypatch.setattr(module, name, spy)
    return counts


def build(client, seed: int, dropout=None) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = client.small if dropout is None else with_dropout(client, client.small, dropout)
    return randomize(client.build(**config).double(), torch.Generator().manual_seed(seed))


class WidenToFloat64(TorchFunctionMode):
    """A client's PyTorch path in float64 throughout: the casts to float32 it makes for precision
    (Boltz's trimul contraction, Protenix's single-track attention) become casts to float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func, args = torch.Tensor.double, args[:1]
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def on_cpu(tensors: dict) -> dict:
    """Results brought back to the CPU (where compare() and the FP64 runs hold them); a CPU
    tensor as it is (no copy)."""
    return {k: (None if v is None else v.detach().cpu()) for k, v in tensors.items()}


def step(client, model, inputs, path, dtype, grad_out, autocast=None, device="cpu"):
    """One forward and backward on a copy of model in dtype on device (inputs, grad_out on the
    CPU): outputs and gradients by name, on the CPU. autocast: its dtype on device's type."""
    model = copy.deepcopy(model).to(device, dtype)
    x = {k: v.detach().to(device, dtype) for k, v in inputs.items()}
    x["s"].requires_grad_(True)
    x["z"].requires_grad_(True)
    widen = WidenToFloat64() if dtype == torch.float64 else contextlib.nullcontext()
    with widen, torch.autocast(torch.device(device).type, dtype=autocast,
                               enabled=autocast is not None):
        s, z = client.run(model, x, path)
    torch.autograd.backward([s, z], [grad_out["s"].to(s.device, s.dtype),
                                     grad_out["z"].to(z.device, z.dtype)])
    grads = {"ds": x["s"].grad, "dz": x["z"].grad}
    grads.update({f"d[{n}]": p.grad for n, p in model.named_parameters()})
    return on_cpu({"s": s, "z": z}), on_cpu(grads)


def case(client, seed):
    gen = torch.Generator().manual_seed(seed)
    c_s, c_z = widths(client, client.small)
    # Protenix pads no tokens (its single track takes no mask: a padded token would reach the
    # real ones there); its pair mask gets holes instead, none on the diagonal.
    inputs = client.inputs(N, c_s, c_z, batch=2 if client.batched else 1,
                           padded=PADDED if client.batched else 0, generator=gen,
                           dtype=torch.float64)
    if not client.batched:
        holes = (torch.rand(N, N, generator=gen) < 0.1) & ~torch.eye(N, dtype=torch.bool)
        inputs["pair_mask"] = inputs["pair_mask"].masked_fill(holes, 0)
    # A loss over real tokens only, as training computes it: what the clients compute at padded
    # tokens differs by path (a query row with every key masked gets a uniform softmax over
    # -1e9-shifted scores in PyTorch, zeros in our op) and reaches no real token.
    valid = {"s": inputs["token_mask"][..., None], "z": inputs["pair_mask"][..., None]}
    grad_out = {k: torch.randn(inputs[k].shape, generator=gen, dtype=torch.float64) * valid[k]
                for k in ("s", "z")}
    return inputs, grad_out, valid


def flipped(tensors: dict) -> dict:
    """The batch in reverse order."""
    return {k: (None if v is None else v.flip(0)) for k, v in tensors.items()}


def compare(out, grads, baselines, out64, grads64, valid, precision, context, per_sample=(),
            terms=None, roundings=None):
    """s, z (real tokens), their input gradients and every parameter gradient by the suite's
    accuracy rule (accuracy.py) against FP64, PyTorch's path the baseline. `baselines` holds one
    or two PyTorch runs (the batch as given and reversed: each sum over the batch, i.e. every
    parameter gradient, rounds differently in each, and the larger error counts, as test_nn).
    per_sample (each sample's FP64 gradients) and terms (accuracy.gradient_terms of the FP64 run):
    the parameter gradients' error model (accuracy.gradient_scale). roundings: (outputs',
    gradients') roundings, by default ROUNDINGS' and GRADIENT_ROUNDINGS' (a stack's)."""
    dtype = torch.bfloat16 if precision == "bf16-autocast" else torch.float32
    out_roundings, grad_roundings = roundings or (ROUNDINGS[precision],
                                                  GRADIENT_ROUNDINGS[precision])

    def check(name, got, base, ref, scale=None, terms=1, roundings=out_roundings):
        assert got is not None, f"{name}: no gradient where FP64 has one; {context}"
        assert_accurate(name, got, base, ref, roundings=roundings, dtype=dtype,
                        scale=scale, terms=terms, context=context)

    for key in out:
        check(key, out[key] * valid[key], [b[0][key] * valid[key] for b in baselines],
              out64[key] * valid[key])
    assert set(grads) == set(grads64)
    for key, ref in grads64.items():
        if ref is None:
            assert grads[key] is None and all(b[1][key] is None for b in baselines), key
            continue
        scale, count = gradient_scale(key, grads64, list(per_sample), terms)
        check(key, grads[key], [b[1][key] for b in baselines], ref, scale, count,
              grad_roundings)


def run_paths(client, model, inputs, grad_out, precision, step=step, device="cpu"):
    """FP64, PyTorch's path (batch as given and reversed) and ours, each (outputs, gradients),
    each sample's FP64 gradients (batched clients) and the FP64 run's gradient terms. The FP64
    runs take the model and inputs as the paths see them, in float32 (accuracy.py), and run the
    client's PyTorch path on the CPU; PyTorch's path and ours run on device. step: a stack's
    (above) or a module's (module_step)."""
    autocast = torch.bfloat16 if precision == "bf16-autocast" else None
    model = copy.deepcopy(model).float().double()
    as_seen = lambda d: {k: (v.float().double() if v is not None and v.is_floating_point() else v)
                         for k, v in d.items()}
    inputs, grad_out = as_seen(inputs), as_seen(grad_out)
    with gradient_terms(model) as terms:
        ref = step(client, model, inputs, "pytorch", torch.float64, grad_out)
    per_sample = []
    if client.batched:
        one = lambda d, b: {k: (None if v is None else v[b:b + 1]) for k, v in d.items()}
        per_sample = [step(client, model, one(inputs, b), "pytorch", torch.float64,
                           one(grad_out, b))[1] for b in range(inputs["z"].shape[0])]
    baselines = [step(client, model, inputs, "pytorch", torch.float32, grad_out, autocast,
                      device=device)]
    if client.batched:
        out_r, g_r = step(client, model, flipped(inputs), "pytorch", torch.float32,
                          flipped(grad_out), autocast, device=device)
        g_r = {k: (v.flip(0) if k in ("ds", "dz") else v) for k, v in g_r.items()}
        baselines.append((flipped(out_r), g_r))
    ours = step(client, model, inputs, "ours", torch.float32, grad_out, autocast, device=device)
    return ref, baselines, ours, per_sample, terms


def blocks_of(client) -> int:
    return next(client.small[k] for k in ("no_blocks", "num_blocks", "n_blocks")
                if k in client.small)


def check_stack(name, precision, seed, counted, device="cpu"):
    """A client's stack on its PyTorch path and ours on device against FP64 (the CPU) by the
    accuracy rule, and what of ours ran (counted)."""
    client = CLIENTS[name]
    model = build(client, seed)
    inputs, grad_out, valid = case(client, seed)
    (out64, g64), baselines, (out, g), per_sample, terms = run_paths(
        client, model, inputs, grad_out, precision, device=device)
    blocks = blocks_of(client)
    # Ours ran, each triangle layer once per block (the PyTorch runs did not count), the triangle
    # attentions and both transitions (pair and single track) fused: a LayerNorm each, the
    # attentions' gates, the transitions' SwiGLU.
    assert counted == {"attention": 2 * blocks, "trimul": 2 * blocks, "layer_norm": 4 * blocks,
                       "gate": 2 * blocks, "swiglu": 2 * blocks}, counted
    compare(out, g, baselines, out64, g64, valid, precision,
            f"{name} {precision} {device} seed {seed}", per_sample, terms)


@pytest.mark.parametrize("precision", ["float32", "bf16-autocast"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_fp64_by_accuracy_rule(name, precision, seed, counted):
    check_stack(name, precision, seed, counted)


# A module alone (the client's triangle attention or pair transition, its update of z): the
# triangle attention's chain is the one derived above; the transition's, in bf16, stores the
# LayerNorm output, both projections (one GEMM), the SwiGLU and the output projection (4), and its
# gradients also the SwiGLU's input gradient, the projections' and the LayerNorm's (7); in float32
# it has fewer of PyTorch's ops between them than the attention (24 as the attention's bound).
TRANSITION_ROUNDINGS = {"16-bit": 4, "16-bit gradients": 7, torch.float32: 24}
# The outgoing triangle multiplication is our one fused op, plus x's rounding to bf16 under
# autocast (as the stack's chain above).
MODULE_TRIMUL_ROUNDINGS = {"16-bit": TRIMUL_ROUNDINGS["16-bit"] + 1,
                           "16-bit gradients": TRIMUL_ROUNDINGS["16-bit gradients"] + 1,
                           torch.float32: TRIMUL_ROUNDINGS[torch.float32]}
MODULE_ROUNDINGS = {"tri_att_start": ATTENTION_ROUNDINGS, "tri_att_end": ATTENTION_ROUNDINGS,
                    "tri_mul_out": MODULE_TRIMUL_ROUNDINGS, "pair_transition": TRANSITION_ROUNDINGS}
# Our ops in each module's forward: (attention, trimul, LayerNorms, gates, SwiGLUs).
MODULE_OPS = {"tri_att_start": (1, 0, 1, 1, 0), "tri_att_end": (1, 0, 1, 1, 0),
              "tri_mul_out": (0, 1, 0, 0, 0), "pair_transition": (0, 0, 1, 0, 1)}


def module_step(kind, client, module, inputs, path, dtype, grad_out, autocast=None,
                device="cpu"):
    """One forward and backward of a pair-stack module (a copy in dtype on device) on z: its
    update and the gradients by name, on the CPU (as step)."""
    module = copy.deepcopy(module).to(device, dtype)
    z = inputs["z"].detach().to(device, dtype).requires_grad_(True)
    widen = WidenToFloat64() if dtype == torch.float64 else contextlib.nullcontext()
    with widen, torch.autocast(torch.device(device).type, dtype=autocast,
                               enabled=autocast is not None):
        out = client.run_module(kind, module, z, inputs["pair_mask"].to(device, dtype), path)
    out.backward(grad_out["out"].to(out.device, out.dtype))
    grads = {"dz": z.grad}
    grads.update({f"d[{n}]": p.grad for n, p in module.named_parameters()})
    return on_cpu({"out": out}), on_cpu(grads)


def build_module(client, kind, seed):
    torch.manual_seed(seed)
    return randomize(client.module(kind, client.small).double(),
                     torch.Generator().manual_seed(seed))


def module_case(client, seed):
    """z and the pair mask of the stacks' case, a gradient of the update over real pairs."""
    inputs, _, valid = case(client, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = {"out": torch.randn(inputs["z"].shape, generator=gen, dtype=torch.float64)
                * valid["z"]}
    return {k: inputs[k] for k in ("z", "pair_mask")}, grad_out, {"out": valid["z"]}


@pytest.mark.parametrize("precision", ["float32", "bf16-autocast"])
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("name", NAMES)
def test_module_matches_fp64_by_accuracy_rule(name, kind, precision, seed, counted):
    """Each client's patched triangle attention (starting and ending node, as its pair stack
    calls them), outgoing triangle multiplication and pair transition alone, our fused forward on the client's parameters against
    its own PyTorch path and FP64 (the update of z over real pairs, dz and every parameter
    gradient), and bitwise the same over repeated steps."""
    check_module(name, kind, precision, seed, counted)


def check_module(name, kind, precision, seed, counted, device="cpu"):
    """test_module_matches_fp64_by_accuracy_rule with the module's PyTorch path and ours on
    device (FP64 on the CPU)."""
    client = CLIENTS[name]
    module = build_module(client, kind, seed)
    inputs, grad_out, valid = module_case(client, seed)
    one_step = functools.partial(module_step, kind)
    (out64, g64), baselines, (out, g), per_sample, terms = run_paths(
        client, module, inputs, grad_out, precision, step=one_step, device=device)
    rules = MODULE_ROUNDINGS[kind]
    roundings = (rules[torch.float32], rules[torch.float32]) if precision == "float32" else \
        (rules["16-bit"], rules["16-bit gradients"])
    compare(out, g, baselines, out64, g64, valid, precision,
            f"{name} {kind} {precision} {device} seed {seed}", per_sample, terms, roundings)
    attention, trimul, ln, gate, swiglu = MODULE_OPS[kind]
    assert counted == {"attention": attention, "trimul": trimul, "layer_norm": ln, "gate": gate,
                       "swiglu": swiglu}, counted
    autocast = torch.bfloat16 if precision == "bf16-autocast" else None
    again = one_step(client, module.float(), inputs, "ours", torch.float32, grad_out, autocast,
                     device=device)
    for got, want in ((again[0], out), (again[1], g)):
        for key, ref in want.items():
            assert (got[key] is None and ref is None) or torch.equal(got[key], ref), key


@pytest.mark.parametrize("name", NAMES)
def test_dropout_as_the_client_applies_it(name, seed, counted):
    """Training mode with the client's dropout on the pair updates: our fused modules leave it
    where the client applies it (on their outputs, the same masks for the same seed), so the
    stack's results on our path are the client's own, to rounding (a mask drawn differently
    would move them by the size of a dropped update): s, z and their gradients (the parameter
    gradients are held to the accuracy rule without dropout, above; a sum that cancels to ~0 has
    no relative error to bound here)."""
    check_dropout(name, seed, counted)


def check_dropout(name, seed, counted, device="cpu"):
    """test_dropout_as_the_client_applies_it with both paths on device."""
    client = CLIENTS[name]
    model = build(client, seed, dropout=0.25).float().train()
    inputs, grad_out, valid = case(client, seed)
    results = {}
    for path in ("pytorch", "ours"):
        torch.manual_seed(seed)
        results[path] = step(client, model, inputs, path, torch.float32, grad_out, device=device)
    assert counted["gate"] > 0 and counted["swiglu"] > 0, counted
    (out, grads), (own, own_grads) = results["ours"], results["pytorch"]
    for key in ("s", "z"):
        err = ((out[key] - own[key]) * valid[key]).abs().max().item()
        assert err <= 1e-4 * (own[key] * valid[key]).abs().max().item(), (key, err)
    for key in ("ds", "dz"):
        err = (grads[key] - own_grads[key]).abs().max().item()
        assert err <= 1e-4 * own_grads[key].abs().max().item(), (key, err)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_bitwise_identical_over_steps(name, seed, counted):
    """Training mode with the client's default dropout (the same masks each step: reseeded)."""
    check_repeatable(name, seed, counted)


def check_repeatable(name, seed, counted, device="cpu", steps=3, autocast=None,
                     between=lambda: None):
    """Outputs and gradients of `steps` steps on our path on device bitwise the same (training
    mode, dropout 0.25, reseeded each step); autocast: its dtype; between(): before each step."""
    client = CLIENTS[name]
    model = build(client, seed, dropout=0.25).float()
    inputs, grad_out, _ = case(client, seed)
    results = []
    for _ in range(steps):
        between()
        torch.manual_seed(seed)
        results.append(step(client, model, inputs, "ours", torch.float32, grad_out, autocast,
                            device=device))
    assert counted["attention"] == steps * 2 * blocks_of(client), counted
    assert counted["trimul"] == steps * 2 * blocks_of(client), counted
    for out, grads in results[1:]:
        for key in ("s", "z"):
            assert torch.equal(out[key], results[0][0][key]), key
        for key, grad in grads.items():
            ref = results[0][1][key]
            assert (grad is None and ref is None) or torch.equal(grad, ref), key


def _seams(name):
    """The client attributes an integration replaces (module or class, attribute name)."""
    integration = CLIENTS[name].integration_module()._integration
    return [(owner, attr) for owner, attr, _ in integration._plan(integration)]


@pytest.mark.parametrize("name", NAMES)
def test_enable_disable_restore_the_client(name, counted):
    module = CLIENTS[name].integration_module()
    seams = _seams(name)
    before = [vars(owner).get(attr, "absent") for owner, attr in seams]
    with module.enabled():
        assert module.is_enabled()
        assert all(vars(owner).get(attr, "absent") is not b for (owner, attr), b in
                   zip(seams, before))
        with module.enabled():  # nested: the inner block leaves it on
            pass
        assert module.is_enabled()
        with module.disabled():
            assert not module.is_enabled()
            assert [vars(owner).get(attr, "absent") for owner, attr in seams] == before
        assert module.is_enabled()
        module.enable()  # idempotent
    assert not module.is_enabled()
    assert [vars(owner).get(attr, "absent") for owner, attr in seams] == before
    module.disable()  # idempotent
    assert [vars(owner).get(attr, "absent") for owner, attr in seams] == before


@pytest.mark.parametrize("name", NAMES)
def test_missing_call_site_names_the_version(name, monkeypatch):
    module = CLIENTS[name].integration_module()
    owner, attr = _seams(name)[0]
    monkeypatch.delattr(owner, attr)
    with pytest.raises(IntegrationError, match=VERSIONS[name]):
        module.enable()
    assert not module.is_enabled()


def test_boltz_community():
    """The boltz tests again, with boltz-community 2.12.0 first on the path."""
    where = Path(sys.prefix) / "clients" / "boltz-community"
    assert (where / "boltz").is_dir(), f"{where} is missing: scripts/setup installs it there"
    path = [str(where)] + [str(Path(p).resolve())
                           for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
               TPF_TEST_BOLTZ_DISTRIBUTION="boltz-community 2.12.0")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "boltz and not community"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
    probe = subprocess.run([sys.executable, "-c", "import boltz; print(boltz.__file__)"],
                           env=env, capture_output=True, text=True)
    assert str(where) in probe.stdout, probe.stdout + probe.stderr


@pytest.mark.parametrize("name", NAMES)
def test_float64_runs_the_clients_own_path(name, seed, counted):
    """What our ops do not take (float64 here) runs the client's own PyTorch path with the
    integration enabled, not our ops: a reference run in float64 (the client's float32 casts
    widened, as the FP64 runs above) gives the client's own float64 results bitwise, forward and
    backward."""
    check_float64_fallback(name, seed, counted)


def check_float64_fallback(name, seed, counted, device="cpu"):
    """test_float64_runs_the_clients_own_path with both runs on device."""
    client = CLIENTS[name]
    model = build(client, seed)
    inputs, grad_out, _ = case(client, seed)
    own = step(client, model, inputs, "pytorch", torch.float64, grad_out, device=device)
    ours = step(client, model, inputs, "ours", torch.float64, grad_out, device=device)
    assert set(counted.values()) == {0}, counted
    for got, want in zip(ours, own):
        assert set(got) == set(want)
        for key, ref in want.items():
            assert got[key].dtype == torch.float64, key
            assert (got[key] is None and ref is None) or torch.equal(got[key], ref), key


@pytest.mark.parametrize("name", NAMES)
def test_our_errors_still_raise(name, seed, monkeypatch):
    """The fallback is decided from the inputs up front: an error inside our ops (a bug) on inputs
    they take still raises."""
    client = CLIENTS[name]
    model = build(client, seed).float()
    inputs, _, _ = case(client, seed)
    inputs = {k: v.float() for k, v in inputs.items()}
    module = client.integration_module()

    def bug(*args, **kwargs):
        raise RuntimeError("a bug in our op")
    for op in ("triangle_attention", "triangle_multiplicative_update"):
        monkeypatch.setattr(module, op, bug)
    with pytest.raises(RuntimeError, match="a bug in our op"):
        client.run(model, inputs, "ours")


def test_which_inputs_our_ops_take():
    """The one rule the integrations' fallbacks share (_patching): float32, bfloat16, float16 on the
    CPU and CUDA; on CUDA, 16-bit attention only with the kernels' head dims (forward 8..128 in
    8s, backward likewise), the triangle multiplication with D a multiple of 8 up to 128."""
    from tpfkit.integrations._patching import (attention_rule, attention_takes,
                                                        glue_rule, glue_takes, trimul_rule,
                                                        trimul_takes)
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    for dtype in (f32, bf16, f16):
        for D in (4, 8, 12, 32, 160):
            assert attention_rule(dtype, "cpu", D, grad=True)
            assert trimul_rule(dtype, "cpu", D)
        assert attention_rule(dtype, "cuda", 32, grad=True)
        assert trimul_rule(dtype, "cuda", 128)
        assert not trimul_rule(dtype, "cuda", 12) and not trimul_rule(dtype, "cuda", 136)
        assert not attention_rule(dtype, "mps", 32, grad=False)
    for D in (8, 24, 48, 128):
        assert attention_rule(bf16, "cuda", D, grad=False)
        assert attention_rule(f32, "cuda", D, grad=True)  # PyTorch's math in the op
        assert attention_rule(f16, "cuda", D, grad=True)
    assert not attention_rule(bf16, "cuda", 12, grad=False)
    assert not attention_rule(bf16, "cuda", 136, grad=False)
    for device in ("cpu", "cuda"):
        assert not attention_rule(f64, device, 32, grad=False)
        assert not trimul_rule(f64, device, 32)
    x = torch.zeros(1, 4, 4, 8)
    assert attention_takes(x, 8) and trimul_takes(x)
    assert not attention_takes(x.double(), 8) and not trimul_takes(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_takes(x, 8) and trimul_takes(x)
        assert not attention_takes(x.double(), 8)
    meta = torch.empty(1, 4, 4, 8, device="meta")
    assert not attention_takes(meta, 8) and not trimul_takes(meta)
    # The fused glue (LayerNorm, gate, SwiGLU): the three dtypes, up to 1024 channels.
    for dtype in (f32, bf16, f16):
        for device in ("cpu", "cuda"):
            assert glue_rule(dtype, device, 128) and glue_rule(dtype, device, 1024)
            assert not glue_rule(dtype, device, 1025)
    assert not glue_rule(f64, "cpu", 128) and not glue_rule(f32, "mps", 128)
    assert glue_takes(x) and not glue_takes(x.double()) and not glue_takes(meta)


def _client_namespace(package: str) -> dict:
    """Every attribute of the client's imported modules and of the classes defined in them, by
    (module or class name, attribute): the object itself (compared by identity)."""
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == package or module_name.startswith(package + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if attr == "__warningregistry__":  # the warnings module's record of what it showed
                continue
            found[(module_name, attr)] = value
            if isinstance(value, type) and value.__module__ == module_name:
                for cls_attr, cls_value in list(vars(value).items()):
                    found[(f"{module_name}.{value.__qualname__}", cls_attr)] = cls_value
    return found


def _module_tree(model: torch.nn.Module) -> dict:
    """Each submodule's class, its forward as the class resolves it, and its instance attributes
    (tensors and modules by identity; the containers' keys)."""
    tree = {}
    for path, m in model.named_modules():
        attrs = {}
        for attr, value in vars(m).items():
            attrs[attr] = tuple(value) if isinstance(value, dict) else id(value) \
                if isinstance(value, (torch.Tensor, torch.nn.Module)) else value
        tree[path] = (type(m), type(m).forward, "forward" in vars(m), attrs)
    return tree


def _own_step(client, model, inputs, grad_out, path):
    """Forward and backward on the model itself (no copy), in float32: outputs and gradients."""
    model.zero_grad(set_to_none=True)
    x = {k: v.detach().float().requires_grad_(k in ("s", "z")) for k, v in inputs.items()}
    s, z = client.run(model, x, path)
    torch.autograd.backward([s, z], [grad_out["s"].float(), grad_out["z"].float()])
    grads = {f"d[{n}]": p.grad for n, p in model.named_parameters()}
    grads.update(ds=x["s"].grad, dz=x["z"].grad)
    model.zero_grad(set_to_none=True)
    return {"s": s.detach(), "z": z.detach(), **grads}


@pytest.mark.parametrize("name", NAMES)
def test_disable_restores_every_module_exactly(name, seed, counted):
    """Before enable() and after disable(), with our ops run in between (forward and backward, in
    training mode, on the model itself): the same state dict bitwise, the same modules (classes,
    forwards, attributes), the same client packages (every module's and class's attributes, by
    identity) and bitwise the same outputs and gradients of the client's path."""
    client = CLIENTS[name]
    module = client.integration_module()
    integration = module._integration
    model = build(client, seed, dropout=0.25).float().train()
    integration._plan(integration)  # imports every client module the integration touches
    inputs, grad_out, _ = case(client, seed)
    assert not module.is_enabled()

    state = {k: v.clone() for k, v in model.state_dict().items()}
    tree = _module_tree(model)
    namespace = _client_namespace(integration.package)
    torch.manual_seed(seed)
    before = _own_step(client, model, inputs, grad_out, "pytorch")

    module.enable()
    try:
        torch.manual_seed(seed)
        _own_step(client, model, inputs, grad_out, "ours")
        model.eval()
        with torch.no_grad():
            client.run(model, {k: v.float() for k, v in inputs.items()}, "ours")
        model.train()
    finally:
        module.disable()
    assert all(counted[k] > 0 for k in ("attention", "trimul", "gate", "swiglu")), counted
    assert not module.is_enabled()

    after_state = model.state_dict()
    assert list(after_state) == list(state)
    for key, value in state.items():
        got = after_state[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got, value), key
    assert _module_tree(model) == tree
    now = _client_namespace(integration.package)
    assert set(now) == set(namespace), sorted(set(now) ^ set(namespace))
    changed = sorted(f"{owner}.{attr}" for (owner, attr), value in namespace.items()
                     if now[(owner, attr)] is not value)
    assert not changed, changed
    torch.manual_seed(seed)
    after = _own_step(client, model, inputs, grad_out, "pytorch")
    assert set(after) == set(before)
    for key, ref in before.items():
        assert (after[key] is None and ref is None) or torch.equal(after[key], ref), key


@pytest.mark.parametrize("name", NAMES)
def test_failed_enable_changes_nothing(name, monkeypatch):
    """enable() is all or nothing: a change that cannot be made undoes those made before it."""
    module = CLIENTS[name].integration_module()
    integration = module._integration
    seams = _seams(name)
    before = [vars(owner).get(attr, "absent") for owner, attr in seams]
    plan = integration._plan

    def failing(it):
        changes = plan(it)

        def fail(original):
            raise RuntimeError("cannot make this change")
        return changes[:-1] + [(changes[-1][0], changes[-1][1], fail)]
    monkeypatch.setattr(integration, "_plan", failing)
    with pytest.raises(RuntimeError, match="cannot make this change"):
        module.enable()
    assert not module.is_enabled()
    assert all(vars(owner).get(attr, "absent") is b for (owner, attr), b in zip(seams, before))
