"""The PairFormer (AlphaFold3 algorithm 17): a pair track and an optional single track, stacked."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tpfkit.nn._layers import check_backend
from tpfkit.nn.attention import AttentionPairBias, TriangleAttention
from tpfkit.nn.transition import Transition
from tpfkit.nn.trimul import TriangleMultiplication


class PairStack(nn.Module):
    """The pair track of one block: z += TriMulOut, TriMulIn, TriAttStart, TriAttEnd, Transition.

    Module names as OpenFold3's PairBlock (tri_mul_out, tri_mul_in, tri_att_start, tri_att_end,
    pair_transition).
    """

    def __init__(self, c_z: int, c_hidden_pair_att: int, no_heads_pair: int, transition_n: int = 4,
                 backend: str = "reference"):
        super().__init__()
        self.tri_mul_out = TriangleMultiplication(c_z, outgoing=True, backend=backend)
        self.tri_mul_in = TriangleMultiplication(c_z, outgoing=False, backend=backend)
        self.tri_att_start = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair,
                                               starting=True, backend=backend)
        self.tri_att_end = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair,
                                             starting=False, backend=backend)
        self.pair_transition = Transition(c_z, transition_n, backend=backend)

    def forward(self, z: torch.Tensor, pair_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        z = z + self.tri_mul_out(z, pair_mask)
        z = z + self.tri_mul_in(z, pair_mask)
        z = z + self.tri_att_start(z, pair_mask)
        z = z + self.tri_att_end(z, pair_mask)
        return z + self.pair_transition(z, pair_mask)


class PairFormerBlock(nn.Module):
    """One PairFormer block. With c_s = 0 it is the pair track alone (s passes through as None).

    Module names as OpenFold3's PairFormerBlock (pair_stack, attn_pair_bias, single_transition).
    """

    def __init__(self, c_z: int, c_s: int = 0, c_hidden_pair_att: int = 32, no_heads_pair: int = 4,
                 c_hidden_pair_bias: int = 24, no_heads_pair_bias: int = 16, transition_n: int = 4,
                 backend: str = "reference"):
        super().__init__()
        self.pair_stack = PairStack(c_z, c_hidden_pair_att, no_heads_pair, transition_n, backend)
        self.c_s = c_s
        if c_s:
            self.attn_pair_bias = AttentionPairBias(c_s, c_z, c_hidden_pair_bias,
                                                    no_heads_pair_bias, backend=backend)
            self.single_transition = Transition(c_s, transition_n, backend=backend)

    def forward(self, s: Optional[torch.Tensor], z: torch.Tensor,
                single_mask: Optional[torch.Tensor] = None,
                pair_mask: Optional[torch.Tensor] = None):
        """s [B, S, c_s] or None; z [B, S, S, c_z]; masks bool [B, S] and [B, S, S]."""
        z = self.pair_stack(z, pair_mask)
        if self.c_s:
            if s is None:
                raise ValueError(f"s must be a [B, S, {self.c_s}] tensor for a block with c_s > 0")
            s = s + self.attn_pair_bias(s, z, single_mask)
            s = s + self.single_transition(s, single_mask)
        return s, z


class PairFormer(nn.Module):
    """no_blocks PairFormerBlocks in sequence (OpenFold3's PairFormerStack: `blocks`).

    checkpoint=True recomputes each block's activations in the backward instead of keeping them.
    """

    def __init__(self, no_blocks: int, c_z: int, c_s: int = 0, c_hidden_pair_att: int = 32,
                 no_heads_pair: int = 4, c_hidden_pair_bias: int = 24, no_heads_pair_bias: int = 16,
                 transition_n: int = 4, backend: str = "reference", checkpoint: bool = False):
        super().__init__()
        if no_blocks < 1:
            raise ValueError(f"no_blocks must be >= 1, got {no_blocks}")
        self.checkpoint = checkpoint
        self.blocks = nn.ModuleList(
            PairFormerBlock(c_z, c_s, c_hidden_pair_att, no_heads_pair, c_hidden_pair_bias,
                            no_heads_pair_bias, transition_n, backend)
            for _ in range(no_blocks))

    def forward(self, s: Optional[torch.Tensor], z: torch.Tensor,
                single_mask: Optional[torch.Tensor] = None,
                pair_mask: Optional[torch.Tensor] = None):
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                s, z = torch.utils.checkpoint.checkpoint(
                    block, s, z, single_mask, pair_mask, use_reentrant=False)
            else:
                s, z = block(s, z, single_mask, pair_mask)
        return s, z


def set_backend(module: nn.Module, backend: str, *, fused_glue: bool = True) -> nn.Module:
    """Switches every submodule that has a backend to `backend`; parameters are untouched.
    fused_glue=False keeps the turbo backend's LayerNorm, SwiGLU and attention gate in PyTorch's
    eager ops (to compare against the fused ones; the reference backend always uses those)."""
    check_backend(backend)
    for m in module.modules():
        if "backend" in vars(m):
            m.backend = backend
        if "fused_glue" in vars(m):
            m.fused_glue = fused_glue
    return module


