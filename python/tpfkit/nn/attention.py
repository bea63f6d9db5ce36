"""Gated multi-head attention with a pair bias: triangle attention and the single track's attention.

Both run through one attention core, `tpfkit.triangle_attention` (backend "turbo") or its
plain PyTorch twin `triangle_attention_torch` (backend "reference"), so masked rows behave the same
in both: a query whose keys are all masked gets zeros and zero gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tpfkit.nn import functional as F
from tpfkit.nn._layers import check_backend, fused_glue, layer_norm, linear
from tpfkit.ops.attention import triangle_attention
from tpfkit.ops.torch_reference import triangle_attention_torch


class GatedAttention(nn.Module):
    """softmax(q k^T / sqrt(c_hidden) + bias) v per slice, gated by sigmoid(x W_g), projected out.

    Parameter names follow OpenFold3's `Attention` (linear_q, linear_k, linear_v, linear_g, linear_o).
    """

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, q_bias: bool = False,
                 backend: str = "reference"):
        super().__init__()
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.backend = check_backend(backend)
        self.fused_glue = True
        hd = c_hidden * no_heads
        self.linear_q = linear(c_in, hd, bias=q_bias, init="glorot")
        self.linear_k = linear(c_in, hd, init="glorot")
        self.linear_v = linear(c_in, hd, init="glorot")
        self.linear_g = linear(c_in, hd, init="final")
        self.linear_o = linear(hd, c_in, init="final")

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, N, S, C]: N slices of S tokens; bias [B, H, S, S] shared by the slices;
        mask bool [B, N, S], True = attend. Returns [B, N, S, C]."""
        # q, k, v and the gate in one GEMM over x (functional.linears); the parameters stay
        # OpenFold3's four layers.
        q, k, v, g = F.linears(x, self.projections).split(self.no_heads * self.c_hidden, dim=-1)
        return F.gated_attention(q, k, v, g, bias, mask, self.linear_o, self.no_heads,
                                 self.c_hidden, fused_glue(self), self.attention)

    @property
    def projections(self) -> tuple[nn.Linear, ...]:
        """The layers of q, k, v and the gate, in the order of their one GEMM's output."""
        return (self.linear_q, self.linear_k, self.linear_v, self.linear_g)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                  mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The attention core on [B, N, H, S, D] heads (context parallelism replaces it)."""
        if self.backend == "turbo":
            return triangle_attention(q, k, v, bias, mask)
        return triangle_attention_torch(q, k, v, bias, mask)


class TriangleAttention(nn.Module):
    """AlphaFold3 algorithms 14 (starting node) and 15 (ending node, by transposing).

    z [B, I, J, C] -> update [B, I, J, C]. Starting node: row i attends over j with bias b[j, k]
    from z itself. Parameter names follow OpenFold3's TriangleAttention (layer_norm, linear_z, mha).
    """

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, starting: bool = True,
                 backend: str = "reference"):
        super().__init__()
        self.starting = starting
        self.layer_norm = nn.LayerNorm(c_in)
        self.linear_z = linear(c_in, no_heads, init="normal")
        self.mha = GatedAttention(c_in, c_hidden, no_heads, backend=backend)

    @property
    def backend(self) -> str:
        return self.mha.backend

    def forward(self, z: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """z [B, I, J, C]; mask bool [B, I, J] (True = valid pair)."""
        if not self.starting:
            z = self.transpose(z)
            mask = None if mask is None else self.transpose(mask)
        # The LayerNorm, the q, k, v, gate and pair-bias projections in one GEMM, the attention,
        # the gate and the output projection: the glue the client integrations run too.
        mha = self.mha
        out = F.triangle_attention_update(
            z, mask, norm=self.layer_norm, q=mha.linear_q, k=mha.linear_k, v=mha.linear_v,
            g=mha.linear_g, bias=self.linear_z, out=mha.linear_o, heads=mha.no_heads,
            head_dim=mha.c_hidden, fused=fused_glue(mha), core=mha.attention)
        return out if self.starting else self.transpose(out)

    def transpose(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, I, J, ...] -> [B, J, I, ...] (context parallelism replaces it with an all-to-all)."""
        return z.transpose(1, 2)


class AttentionPairBias(nn.Module):
    """AlphaFold3 algorithm 24 without AdaLN, as the PairFormer's single track uses it.

    s [B, S, c_s] attends over its own tokens with a bias from the pair representation z. Runs on
    the same attention core as the triangle attention, with one slice. Parameter names follow
    OpenFold3's AttentionPairBias (layer_norm_a, layer_norm_z, linear_z, mha).
    """

    def __init__(self, c_s: int, c_z: int, c_hidden: int, no_heads: int,
                 backend: str = "reference"):
        super().__init__()
        self.layer_norm_a = nn.LayerNorm(c_s)
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.linear_z = linear(c_z, no_heads, init="normal")
        self.mha = GatedAttention(c_s, c_hidden, no_heads, q_bias=True, backend=backend)

    def forward(self, s: torch.Tensor, z: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """s [B, S, c_s]; z [B, S, S, c_z]; mask bool [B, S] (True = valid token)."""
        glue = fused_glue(self.mha)
        bias = self.linear_z(layer_norm(self.layer_norm_z, z, glue)).permute(0, 3, 1, 2)
        out = self.mha(layer_norm(self.layer_norm_a, s, glue).unsqueeze(1), bias,
                       None if mask is None else mask.unsqueeze(1))
        return out.squeeze(1)
