"""Linear layers with AlphaFold3's initializations, the backend names the modules accept, and
whether a module runs the fused glue (the glue itself: tpfkit.nn.functional)."""
from __future__ import annotations

import math

import torch
from torch import nn

from tpfkit.nn.functional import fusable, layer_norm  # noqa: F401  (the modules' LayerNorm)
from tpfkit.ops._common import autocast_dtype  # noqa: F401

BACKENDS = ("reference", "turbo")

# The standard deviation of a unit normal truncated at +-2, to undo the truncation's shrinkage.
_TRUNC_STD = 0.87962566103423978


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def linear(c_in: int, c_out: int, bias: bool = False, init: str = "default") -> nn.Linear:
    """nn.Linear initialized as AlphaFold3 does (OpenFold3's names for the schemes).

    default: LeCun normal (truncated at 2 sigma); relu: He normal (truncated); glorot: Xavier
    uniform; normal: N(0, 1/c_in); gating: zero weights and bias 1, so gates start mostly open;
    final: zeros, so every residual branch starts as the identity.
    """
    layer = nn.Linear(c_in, c_out, bias=bias)
    with torch.no_grad():
        if init in ("default", "relu"):
            std = math.sqrt((2.0 if init == "relu" else 1.0) / c_in) / _TRUNC_STD
            nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
        elif init == "glorot":
            nn.init.xavier_uniform_(layer.weight)
        elif init == "normal":
            nn.init.normal_(layer.weight, std=1.0 / math.sqrt(c_in))
        elif init in ("gating", "final"):
            layer.weight.zero_()
        else:
            raise ValueError(
                f"init must be default, relu, glorot, normal, gating or final, got {init!r}")
        if bias:
            layer.bias.fill_(1.0 if init == "gating" else 0.0)
    return layer


def fused_glue(module: nn.Module) -> bool:
    """Whether `module` (one with a backend) runs LayerNorm, SwiGLU and the attention gate through
    the fused ops (tpfkit.ops.glue): on the turbo backend, where they are faster than
    PyTorch's eager ops (bench/notes-train.md), unless set_backend(..., fused_glue=False) chose
    PyTorch's ops to compare against; never under torch.compile, whose generated kernels fuse this
    glue into its neighbours."""
    return module.backend == "turbo" and module.fused_glue and fusable()
