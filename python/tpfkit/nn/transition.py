"""The SwiGLU transition (AlphaFold3 algorithm 11), used on the pair track and the single track."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tpfkit.nn import functional as F
from tpfkit.nn._layers import check_backend, fused_glue, linear


class SwiGLU(nn.Module):
    def __init__(self, c_in: int, c_hidden: int):
        super().__init__()
        self.linear_a = linear(c_in, c_hidden, init="relu")
        self.linear_b = linear(c_in, c_hidden, init="relu")

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return F.swiglu(x, a=self.linear_a, b=self.linear_b, fused=fused)


class Transition(nn.Module):
    """LayerNorm, SwiGLU to n * c_in channels, back to c_in; masked rows give zeros.

    Parameter names follow OpenFold3's SwiGLUTransition (layer_norm, swiglu, linear_out). Both
    backends run the same GEMMs (functional.swiglu_transition, which the client integrations run
    too); the turbo backend's LayerNorm and SwiGLU are our fused kernels.
    """

    def __init__(self, c_in: int, n: int = 4, backend: str = "reference"):
        super().__init__()
        self.backend = check_backend(backend)
        self.fused_glue = True
        self.layer_norm = nn.LayerNorm(c_in)
        self.swiglu = SwiGLU(c_in, n * c_in)
        self.linear_out = linear(n * c_in, c_in, init="final")

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., c_in]; mask bool [...] (True = valid)."""
        out = F.swiglu_transition(x, norm=self.layer_norm, a=self.swiglu.linear_a,
                                  b=self.swiglu.linear_b, out=self.linear_out,
                                  fused=fused_glue(self))
        return out if mask is None else out * mask.unsqueeze(-1).to(out.dtype)


PairTransition = Transition
