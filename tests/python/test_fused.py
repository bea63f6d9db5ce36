"""The fused glue ops on the CPU path: against FP64, errors for bad input, custom-op registration
(torch.library.opcheck: fake tensors, autograd, torch.compile's view of them)."""
import pytest
import torch

from fused_cases import GATE_CASES, LN_CASES, SWIGLU_CASES, gate_case, layer_norm_case, swiglu_case
from turbopairformer.ops import fused

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("case", LN_CASES)
@pytest.mark.parametrize("x_dtype,y_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_layer_norm_matches_fp64(case, x_dtype, y_dtype, seed):
    layer_norm_case(*case, x_dtype, y_dtype, "cpu", torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", SWIGLU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_fp64(case, dtype, seed):
    swiglu_case(*case, dtype, "cpu", torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", GATE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_output_matches_fp64(case, dtype, seed):
    gate_case(*case, dtype, "cpu", torch.Generator().manual_seed(seed))


def test_layer_norm_bad_input_names_the_argument():
    x = torch.randn(2, 3, 8)
    w, b = torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match="weight must have shape \\[8\\]"):
        fused.layer_norm(x, torch.ones(7), b)
    with pytest.raises(ValueError, match="eps must be a positive number"):
        fused.layer_norm(x, w, b, eps=0.0)
    with pytest.raises(TypeError, match="out_dtype must be"):
        fused.layer_norm(x, w, b, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        fused.layer_norm(x.long(), w, b)
    with pytest.raises(ValueError, match="channels in its last dimension"):
        fused.layer_norm(torch.randn(2, 1025), torch.ones(1025), torch.zeros(1025))


def test_layer_norm_reads_overlapping_and_high_rank_inputs():
    """An expanded (overlapping) x and one with more than three leading dims take a copy first."""
    w, b = torch.randn(8), torch.randn(8)
    for x in (torch.randn(1, 3, 8).expand(4, 3, 8), torch.randn(2, 2, 2, 2, 3, 8)):
        want = torch.nn.functional.layer_norm(x, (8,), w, b)
        torch.testing.assert_close(fused.layer_norm(x, w, b), want, rtol=1e-5, atol=1e-5)


def test_swiglu_and_gate_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="ab must have an even last dim"):
        fused.swiglu(torch.randn(3, 5))
    o = torch.randn(1, 2, 4, 3, 8)
    with pytest.raises(ValueError, match="g must have shape \\[1, 2, 3, 32\\]"):
        fused.gated_output(torch.randn(1, 2, 3, 31), o)
    with pytest.raises(ValueError, match="o must have g's dtype"):
        fused.gated_output(torch.randn(1, 2, 3, 32, dtype=torch.bfloat16), o)


def test_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, 16, generator=g, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    torch.library.opcheck(fused._ln_fwd, (x.transpose(1, 2), w, b, 1e-5, torch.bfloat16))
    torch.library.opcheck(fused._swiglu_fwd, (torch.randn(7, 10, requires_grad=True),))
    wide = torch.randn(6, 32, requires_grad=True)
    torch.library.opcheck(fused._gate_fwd, (wide[:, 24:], torch.randn(2, 2, 3, 4, requires_grad=True)))


def test_glue_under_torch_compile_matches_eager():
    """torch.compile traces the ops through their fake implementations (fullgraph: no breaks)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, 16, generator=g)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    ab = torch.randn(9, 12, generator=g)

    def f(x, w, b, ab):
        return fused.layer_norm(x.transpose(1, 2), w, b).sum() + fused.swiglu(ab).sum()

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w, b, ab), f(x, w, b, ab))
