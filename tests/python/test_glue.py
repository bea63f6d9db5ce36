"""The fused glue ops on the CPU path: against FP64, errors for bad input, custom-op registration
(torch.library.opcheck: fake tensors, autograd, torch.compile's view of them)."""
import re

import pytest
import torch

from glue_cases import GATE_CASES, LN_CASES, SWIGLU_CASES, gate_case, layer_norm_case, swiglu_case
from tpfkit.ops import glue

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


LAYER_NORM_BAD_INPUTS = [  # x [2, 3, 8], weight and bias [8]
    (ValueError, "weight must have shape [C] (x's last dim) = [8], got [7]",
     lambda x, w, b: ((x, w[:-1], b), {})),
    (ValueError, "bias must have shape [C] (x's last dim) = [8], got [9]",
     lambda x, w, b: ((x, w, torch.zeros(9)), {})),
    (ValueError, "eps must be a positive number, got 0",
     lambda x, w, b: ((x, w, b), {"eps": 0.0})),
    (TypeError, "eps must be a number, got NoneType",
     lambda x, w, b: ((x, w, b), {"eps": None})),
    (TypeError, "out_dtype must be float32, bfloat16 or float16, got torch.int32",
     lambda x, w, b: ((x, w, b), {"out_dtype": torch.int32})),
    (ValueError, "x must be float32, bfloat16 or float16, got int64",
     lambda x, w, b: ((x.long(), w, b), {})),
    (ValueError, "x must have 1 to 1024 channels in its last dimension, got 1025",
     lambda x, w, b: ((torch.randn(2, 1025), torch.ones(1025), torch.zeros(1025)), {})),
    (ValueError, "x must have 1 to 4 dimensions ([..., C]), got []",
     lambda x, w, b: ((torch.tensor(1.0), w[:1], b[:1]), {})),
    (TypeError, "bias must be a torch.Tensor, got float",
     lambda x, w, b: ((x, w, 0.0), {})),
]


@pytest.mark.parametrize("kind,message,mutate", LAYER_NORM_BAD_INPUTS,
                         ids=[m for _, m, _ in LAYER_NORM_BAD_INPUTS])
def test_layer_norm_bad_input_names_the_argument(kind, message, mutate):
    args, kwargs = mutate(torch.randn(2, 3, 8), torch.ones(8), torch.zeros(8))
    with pytest.raises(kind, match=re.escape(message)):
        glue.layer_norm(*args, **kwargs)


def test_layer_norm_reads_overlapping_and_high_rank_inputs():
    """An expanded (overlapping) x and one with more than three leading dims take a copy first."""
    w, b = torch.randn(8), torch.randn(8)
    for x in (torch.randn(1, 3, 8).expand(4, 3, 8), torch.randn(2, 2, 2, 2, 3, 8)):
        want = torch.nn.functional.layer_norm(x, (8,), w, b)
        torch.testing.assert_close(glue.layer_norm(x, w, b), want, rtol=1e-5, atol=1e-5)


GLUE_BAD_INPUTS = [  # o [1, 2, 4, 3, 8]: g [1, 2, 3, 32]
    (ValueError, "ab must have shape [M, 2H] (a then b: an even last dim), got [3, 5]",
     lambda o: (glue.swiglu, torch.randn(3, 5))),
    (ValueError, "ab must have shape [..., 2H] (a then b), got []",
     lambda o: (glue.swiglu, torch.tensor(1.0))),
    (ValueError, "ab must be float32, bfloat16 or float16, got int64",
     lambda o: (glue.swiglu, torch.ones(3, 4, dtype=torch.long))),
    (ValueError, "g must have shape [1, 2, 3, 32] (o's [..., H, S, D] as [..., S, H*D]), got "
                 "[1, 2, 3, 31]",
     lambda o: (glue.gated_output, torch.randn(1, 2, 3, 31), o)),
    (ValueError, "o must have shape [..., H, S, D], got [4, 8]",
     lambda o: (glue.gated_output, torch.randn(4, 8), o[0, 0, :, 0])),
    (ValueError, "o must have g's dtype bfloat16, got float32",
     lambda o: (glue.gated_output, torch.randn(1, 2, 3, 32, dtype=torch.bfloat16), o)),
    (ValueError, "g must be float32, bfloat16 or float16, got float64",
     lambda o: (glue.gated_output, torch.randn(1, 2, 3, 32, dtype=torch.float64), o.double())),
    (TypeError, "o must be a torch.Tensor, got NoneType",
     lambda o: (glue.gated_output, torch.randn(1, 2, 3, 32), None)),
]


@pytest.mark.parametrize("kind,message,mutate", GLUE_BAD_INPUTS,
                         ids=[m for _, m, _ in GLUE_BAD_INPUTS])
def test_swiglu_and_gate_bad_input_names_the_argument(kind, message, mutate):
    fn, *args = mutate(torch.randn(1, 2, 4, 3, 8))
    with pytest.raises(kind, match=re.escape(message)):
        fn(*args)


def test_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, 16, generator=g, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    torch.library.opcheck(glue._ln_fwd, (x.transpose(1, 2), w, b, 1e-5, torch.bfloat16))
    torch.library.opcheck(glue._swiglu_fwd, (torch.randn(7, 10, requires_grad=True),))
    wide = torch.randn(6, 32, requires_grad=True)
    torch.library.opcheck(glue._gate_fwd, (wide[:, 24:], torch.randn(2, 2, 3, 4, requires_grad=True)))


def test_glue_under_torch_compile_matches_eager():
    """torch.compile traces the ops through their fake implementations (fullgraph: no breaks)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, 16, generator=g)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    ab = torch.randn(9, 12, generator=g)

    def f(x, w, b, ab):
        return glue.layer_norm(x.transpose(1, 2), w, b).sum() + glue.swiglu(ab).sum()

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w, b, ab), f(x, w, b, ab))
