"""tpfkit.integrations inside the client packages' own PairFormer stacks on CUDA (issue 30): the
checks of tests/python/test_integrations.py (whose helpers these are, given a device) with the
client's stack, its PyTorch path and ours on the GPU, our CUDA kernels inside.

Each client's stack (its small test configuration, N = 24, padded) forward and backward on its
PyTorch path and on ours, in float32 and under bf16 autocast ("cuda"), both held against an FP64
run of the client's PyTorch path on the CPU (WidenToFloat64, as the CPU tests) by the suite's
accuracy rule (accuracy.py): s, z, their input gradients and every parameter gradient; each
triangle attention and pair transition alone likewise; ours really ran (the `counted` spies on
the integrations' ops and the fused glue); 5 steps bitwise identical (training mode, dropout);
the client's dropout where it applies it; float64 and head dims the 16-bit kernels do not take
run the client's own attention with the integration enabled.

Error bounds: the CPU tests' (ROUNDINGS, GRADIENT_ROUNDINGS, MODULE_ROUNDINGS), unchanged. They
count the values our design stores in the working dtype, and the CUDA kernels store the same
ones: under bf16 autocast the attention kernels round P and O, the trimul kernels a or b, z, the
gate logits and the output, the glue its outputs, to bfloat16 (the chains the GPU op tests hold
them to: attention_cases' and trimul_cases' ROUNDINGS_16BIT, test_glue_gpu's BLOCK_ROUNDINGS, as
the CPU's); in float32 the attention takes PyTorch's math inside our op (attention_rule: fewer
roundings than the CPU chain counts) and the trimul kernels compute in float32 (trimul_cases'
ROUNDINGS_FP32 = 25 on CUDA as on the CPU). The baseline is the client's PyTorch path on CUDA in
the same precision (cuBLAS, PyTorch's CUDA ops), float32 matmuls at "highest" (no TF32).

Needs the client packages (scripts/gpu-check installs .whl/ from scripts/fetch-client-wheels; a
client that is missing skips); biotite and rdkit, absent on the GPU machine, get the placeholders
of tpfkit.benchmarks.clients_gpu (the PairFormer modules only import names from them).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import poison_allocator
from test_integrations import (CLIENTS, NAMES, blocks_of, case, check_dropout,
                               check_float64_fallback, check_module, check_repeatable,
                               check_stack, compare, counted, protenix_layer_norm, run_paths)
from test_nn import randomize
from tpfkit.benchmarks.clients import MODULES

__all__ = ["counted", "protenix_layer_norm"]  # the CPU tests' fixtures, used here

DEVICE = "cuda"
PRECISIONS = ["float32", "bf16-autocast"]
PACKAGES = {"openfold3": "openfold3", "boltz": "boltz", "protenix": "protenix"}


@pytest.fixture(scope="module", autouse=True)
def placeholders():
    """Placeholders for biotite and rdkit where they are absent (the GPU machine)."""
    from tpfkit.benchmarks.clients_gpu import placeholder_modules
    placeholder_modules()


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """The float32 baseline in float32 (a client's entry point may turn TF32 on)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def installed(name):
    if importlib.util.find_spec(PACKAGES[name]) is None:
        pytest.skip(f"{PACKAGES[name]} is not installed (scripts/fetch-client-wheels, .whl/)")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", NAMES)
def test_stack_matches_fp64_by_accuracy_rule_on_cuda(name, precision, seed, counted):
    installed(name)
    check_stack(name, precision, seed, counted, device=DEVICE)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("name", NAMES)
def test_module_matches_fp64_by_accuracy_rule_on_cuda(name, kind, precision, seed, counted):
    """Also bitwise the same on a second step (check_module)."""
    installed(name)
    check_module(name, kind, precision, seed, counted, device=DEVICE)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", NAMES)
def test_gradients_bitwise_identical_over_steps_on_cuda(name, precision, seed, counted):
    """5 training steps (dropout 0.25, reseeded) on our path, outputs and every gradient bitwise
    the same, on a poisoned allocator (an element a kernel leaves unwritten would differ)."""
    installed(name)
    autocast = torch.bfloat16 if precision == "bf16-autocast" else None
    check_repeatable(name, seed, counted, device=DEVICE, steps=5, autocast=autocast,
                     between=poison_allocator if DEVICE == "cuda" else lambda: None)


@pytest.mark.parametrize("name", NAMES)
def test_dropout_as_the_client_applies_it_on_cuda(name, seed, counted):
    installed(name)
    check_dropout(name, seed, counted, device=DEVICE)


@pytest.mark.parametrize("name", NAMES)
def test_float64_runs_the_clients_own_path_on_cuda(name, seed, counted):
    installed(name)
    check_float64_fallback(name, seed, counted, device=DEVICE)


# Head dim 12: not one the 16-bit CUDA attention kernels take (8, 16, ..., 128). Protenix's small
# stack has head dim 32 fixed by its widths (c_z / 32 heads), so it is left out.
HEAD_DIM_KEYS = {"openfold3": "c_hidden_pair_att", "boltz": "pairwise_head_width"}


@pytest.mark.parametrize("name", list(HEAD_DIM_KEYS))
def test_head_dim_the_kernels_do_not_take_runs_the_clients_attention_on_cuda(name, seed,
                                                                            counted):
    """Under bf16 autocast with triangle heads of dim 12, the client's triangle attention modules
    run their own forward (attention_rule, decided up front) while the trimul and transitions run
    ours; the stack is still held to the accuracy rule against FP64."""
    installed(name)
    client = CLIENTS[name]
    torch.manual_seed(seed)
    config = {**client.small, HEAD_DIM_KEYS[name]: 12}
    model = randomize(client.build(**config).double(), torch.Generator().manual_seed(seed))
    inputs, grad_out, valid = case(client, seed)
    precision = "bf16-autocast"
    (out64, g64), baselines, (out, g), per_sample, terms = run_paths(
        client, model, inputs, grad_out, precision, device=DEVICE)
    blocks = blocks_of(client)
    # The transitions' LayerNorms and SwiGLUs are ours; no attention, no attention gate.
    assert counted == {"attention": 0, "trimul": 2 * blocks, "layer_norm": 2 * blocks,
                       "gate": 0, "swiglu": 2 * blocks}, counted
    compare(out, g, baselines, out64, g64, valid, precision,
            f"{name} head dim 12 {precision} {DEVICE} seed {seed}", per_sample, terms)
