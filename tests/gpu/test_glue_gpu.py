"""The fused glue ops' CUDA kernels against FP64 (PyTorch's ops at the same precision as the
yardstick), on a poisoned allocator so that an unwritten element shows up, bitwise reproducible
from call to call; and a PairFormer block's turbo backend against the reference on the GPU."""
import copy

import pytest
import torch

from conftest import poison_allocator
from glue_cases import GATE_CASES, LN_CASES, SWIGLU_CASES, gate_case, layer_norm_case, swiglu_case
from test_nn import BLOCK_ROUNDINGS, check_backends_agree, masks, randomize
from tpfkit.nn import PairFormerBlock

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def repeatable(run):
    """run() twice on a poisoned allocator: both results equal bit for bit."""
    poison_allocator()
    first = run()
    poison_allocator()
    again = run()
    for a, b in zip(first, again):
        assert torch.equal(a, b), "results differ between calls"


@pytest.mark.parametrize("case", LN_CASES)
@pytest.mark.parametrize("x_dtype,y_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float32)])
def test_layer_norm_matches_fp64(case, x_dtype, y_dtype, seed):
    repeatable(lambda: layer_norm_case(*case, x_dtype, y_dtype, "cuda",
                                       torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("case", SWIGLU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_fp64(case, dtype, seed):
    repeatable(lambda: swiglu_case(*case, dtype, "cuda", torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("case", GATE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_output_matches_fp64(case, dtype, seed):
    repeatable(lambda: gate_case(*case, dtype, "cuda", torch.Generator().manual_seed(seed)))


def test_layer_norm_large_rows_deterministic(seed):
    """More rows than the backward has blocks (1024 x 8 warps): every block takes several rows,
    and the weight gradients stay bitwise reproducible."""
    repeatable(lambda: layer_norm_case(1, 97, 101, 128, True, torch.float32, torch.bfloat16,
                                       "cuda", torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("S", [7, 33])
@pytest.mark.parametrize("glue", [True, False])
def test_pairformer_block_backends_agree_on_gpu(S, glue, seed):
    """The whole block (single track included) on the GPU in bfloat16, with the fused glue and
    without: turbo within FlashAttention-3's rule of the reference, against FP64 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    # head dims 16: the smallest the CUDA attention kernels take
    block = randomize(PairFormerBlock(16, c_s=8, c_hidden_pair_att=16, no_heads_pair=2,
                                      c_hidden_pair_bias=16, no_heads_pair_bias=2).double(), gen)
    s = torch.randn(2, S, 8, generator=gen, dtype=torch.float64)
    z = torch.randn(2, S, S, 16, generator=gen, dtype=torch.float64)
    token, pair = masks(2, S, gen)

    def call(m, s, z, token, pair):
        # the reference in float64 stays on the CPU; bfloat16 runs on the GPU
        if s.dtype != torch.float64:
            m = m.cuda()
            for sub in m.modules():  # what set_backend(..., fused_glue=glue) sets
                if "fused_glue" in vars(sub):
                    sub.fused_glue = glue
            s, z, token, pair = (t.cuda() for t in (s, z, token, pair))
            out = m(s, z, token, pair)
            return tuple(o.cpu() for o in out)
        return m(s, z, token, pair)

    check_backends_agree(block, [s, z, token, pair], call, torch.bfloat16, seed,
                         BLOCK_ROUNDINGS, parameter_grads=False)
