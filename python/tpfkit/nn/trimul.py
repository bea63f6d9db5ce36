"""The triangle multiplicative update as a module: AlphaFold3 algorithms 12 (outgoing) and 13 (incoming)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tpfkit.nn._layers import autocast_dtype, check_backend, linear
from tpfkit.ops.torch_reference import triangle_multiplicative_update_torch
from tpfkit.ops.trimul import triangle_multiplicative_update


class TriangleMultiplication(nn.Module):
    """z [B, S, S, c_z] -> update [B, S, S, c_z], hidden channels = c_z as in AlphaFold3.

    Parameter names follow OpenFold3's TriangleMultiplicativeUpdate (layer_norm_in, linear_a_p,
    linear_a_g, linear_b_p, linear_b_g, layer_norm_out, linear_z, linear_g; no biases), so its
    weights load as they are. Both backends take the weights in cuEquivariance's layout: the a and
    b projections stacked into one [2 c_z, c_z] matrix.
    """

    def __init__(self, c_z: int, outgoing: bool = True, backend: str = "reference"):
        super().__init__()
        self.outgoing = outgoing
        self.backend = check_backend(backend)
        self.layer_norm_in = nn.LayerNorm(c_z)
        self.linear_a_p = linear(c_z, c_z)
        self.linear_a_g = linear(c_z, c_z, init="gating")
        self.linear_b_p = linear(c_z, c_z)
        self.linear_b_g = linear(c_z, c_z, init="gating")
        self.layer_norm_out = nn.LayerNorm(c_z)
        self.linear_z = linear(c_z, c_z, init="final")
        self.linear_g = linear(c_z, c_z, init="gating")

    @property
    def direction(self) -> str:
        return "outgoing" if self.outgoing else "incoming"

    def op_weights(self) -> dict[str, torch.Tensor]:
        """The weights as triangle_multiplicative_update's keyword arguments."""
        return dict(
            norm_in_weight=self.layer_norm_in.weight, norm_in_bias=self.layer_norm_in.bias,
            p_in_weight=torch.cat([self.linear_a_p.weight, self.linear_b_p.weight]),
            g_in_weight=torch.cat([self.linear_a_g.weight, self.linear_b_g.weight]),
            norm_out_weight=self.layer_norm_out.weight, norm_out_bias=self.layer_norm_out.bias,
            p_out_weight=self.linear_z.weight, g_out_weight=self.linear_g.weight)

    def forward(self, z: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """z [B, S, S, c_z]; mask bool [B, S, S] (True = valid pair)."""
        weights = self.op_weights()
        direction = self.direction
        if self.backend == "reference":
            return triangle_multiplicative_update_torch(z, direction, mask, **weights)
        # A custom op is invisible to autocast: give it x in the autocast dtype, so under bf16
        # autocast it runs in bf16 as the reference's matmuls do (it keeps the weights in float32).
        return triangle_multiplicative_update(z.to(autocast_dtype(z) or z.dtype),
                                              direction=direction, mask=mask, **weights)
