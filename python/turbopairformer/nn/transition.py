"""The SwiGLU transition (AlphaFold3 algorithm 11), used on the pair track and the single track."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from turbopairformer.nn._layers import check_backend, fused_glue, layer_norm, linear
from turbopairformer.ops.fused import swiglu


class SwiGLU(nn.Module):
    def __init__(self, c_in: int, c_hidden: int):
        super().__init__()
        self.linear_a = linear(c_in, c_hidden, init="relu")
        self.linear_b = linear(c_in, c_hidden, init="relu")

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        # Both projections in one GEMM (one read and one autocast cast of x); with `fused`, silu(a)
        # * b and its gradient in one kernel each (turbopairformer.ops.fused.swiglu).
        weight = torch.cat([self.linear_a.weight, self.linear_b.weight])
        ab = nn.functional.linear(x, weight)
        if fused:
            return swiglu(ab)
        a, b = ab.chunk(2, dim=-1)
        return nn.functional.silu(a) * b


class Transition(nn.Module):
    """LayerNorm, SwiGLU to n * c_in channels, back to c_in; masked rows give zeros.

    Parameter names follow OpenFold3's SwiGLUTransition (layer_norm, swiglu, linear_out). It has no
    custom op: both backends run the same PyTorch code, and `backend` exists so that a whole trunk
    switches with one argument.
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
        glue = fused_glue(self)
        h = self.swiglu(layer_norm(self.layer_norm, x, glue), glue)
        out = self.linear_out(h)
        return out if mask is None else out * mask.unsqueeze(-1).to(out.dtype)


PairTransition = Transition
