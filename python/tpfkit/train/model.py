"""The distogram model: sequence features -> pair representation -> PairFormer trunk -> distance bins."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from tpfkit.nn import PairFormer
from tpfkit.nn._layers import linear
from tpfkit.train.features import NUM_TYPES, distogram_targets


@dataclass
class ModelConfig:
    blocks: int = 2
    c_z: int = 32
    heads: int = 4
    head_dim: int = 8
    transition_n: int = 2
    relpos_max: int = 32      # |i - j| beyond this shares one bin (AlphaFold3's r_max)
    bins: int = 64            # AlphaFold3's distogram: 64 bins over 2-22 angstrom
    min_dist: float = 2.0
    max_dist: float = 22.0
    checkpoint: bool = False  # recompute each block in the backward (activation checkpointing)

    def to_dict(self) -> dict:
        return asdict(self)


class DistogramModel(nn.Module):
    """z_ij = W_i t_i + W_j t_j + W_rel onehot(clip(r_j - r_i)); z = PairFormer(z);
    logits_ij = W_d (z_ij + z_ji). t: residue-type one-hot, r: residue numbers."""

    def __init__(self, config: ModelConfig, backend: str = "reference"):
        super().__init__()
        self.config = config
        c = config.c_z
        self.linear_z_i = linear(NUM_TYPES, c)
        self.linear_z_j = linear(NUM_TYPES, c)
        self.linear_relpos = linear(2 * config.relpos_max + 1, c)
        self.pairformer = PairFormer(config.blocks, c, c_hidden_pair_att=config.head_dim,
                                     no_heads_pair=config.heads, transition_n=config.transition_n,
                                     backend=backend, checkpoint=config.checkpoint)
        # Not zero-initialized (AlphaFold3 zeroes it): with every residual branch at zero too, the
        # trunk would get no gradient in the first step.
        self.distogram = linear(c, config.bins)
        self.register_buffer("boundaries", torch.linspace(
            config.min_dist, config.max_dist, config.bins - 1), persistent=False)

    def forward(self, aatype: torch.Tensor, residue_index: torch.Tensor,
                token_mask: torch.Tensor) -> torch.Tensor:
        """aatype, residue_index [B, N] long; token_mask [B, N] bool -> logits [B, N, N, bins]."""
        dtype = self.linear_z_i.weight.dtype
        t = nn.functional.one_hot(aatype, NUM_TYPES).to(dtype)
        r = self.config.relpos_max
        rel = (residue_index[:, None, :] - residue_index[:, :, None]).clamp(-r, r) + r
        z = (self.linear_z_i(t)[:, :, None] + self.linear_z_j(t)[:, None, :]
             + self.linear_relpos(nn.functional.one_hot(rel, 2 * r + 1).to(dtype)))
        pair_mask = token_mask[:, :, None] & token_mask[:, None, :]
        _, z = self.pairformer(None, z, None, pair_mask)
        return self.distogram(z + z.transpose(1, 2))

    def loss(self, batch: dict) -> torch.Tensor:
        """Mean cross-entropy over the pairs whose two pseudo-beta atoms are both present."""
        logits = self(batch["aatype"], batch["residue_index"], batch["token_mask"])
        targets, pair_mask = distogram_targets(batch["positions"], batch["position_mask"],
                                               self.boundaries)
        ce = nn.functional.cross_entropy(logits.float().flatten(0, 2), targets.flatten(),
                                         reduction="none")
        weight = pair_mask.flatten().to(ce.dtype)
        return (ce * weight).sum() / weight.sum().clamp(min=1.0)
