"""ContextParallel: a PairFormer whose pair representation is sharded by rows over a process group.

The wrapper runs the model's own forward code on this rank's rows. Its module tree is a copy of the
model's that shares every parameter (same Parameter objects, same state-dict keys); only the parts
that reach across rows are swapped for sharded ones:
- triangle multiplication: the contraction goes through channel sharding, and the row-local stages
  are recomputed in the backward (sharded_triangle_multiplicative_update);
- triangle attention: the core runs the bias ring, and the ending node's transposes are all-to-alls;
- the single track's attention pair bias: s is on every rank, each rank runs the queries whose bias
  rows it holds, and the outputs are gathered.
LayerNorms, projections and transitions are row-local and run unchanged.

Gradients: the training loss is the sum of the ranks' pair-loss terms (each over its own rows)
plus a single-track loss that every rank computes alike from s, which is replicated (the same bits
on every rank, with the same gradient). Replicated tensors and the single track's parameters thus
get their full gradients on every rank; a parameter applied to rows of z gets this rank's part,
and all_reduce_gradients() sums those over the ranks after backward.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tpfkit.distributed.attention import ring_triangle_attention
from tpfkit.distributed.collectives import gather_rows, sum_gradients, transpose_pair
from tpfkit.distributed.sharding import RowSharding
from tpfkit.distributed.trimul import sharded_triangle_multiplicative_update
from tpfkit.nn.attention import AttentionPairBias, GatedAttention, TriangleAttention
from tpfkit.nn.pairformer import PairFormer, PairFormerBlock, PairStack
from tpfkit.nn.trimul import TriangleMultiplication
from tpfkit.ops.attention import triangle_attention_rows

__all__ = ["ContextParallel"]


@dataclass(frozen=True)
class _Context:
    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    trimul_chunks: int
    trimul_recompute: bool

    def sharding(self, n_padded: int) -> RowSharding:
        """The sharding of a padded pair tensor; the primitives treat padding as masked tokens."""
        return RowSharding(n_padded, self.world, self.rank, self.group)


class _ShardedTriangleMultiplication(TriangleMultiplication):
    def forward(self, z: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        context = self.cp_context
        return sharded_triangle_multiplicative_update(
            z, self.direction, mask, context.sharding(z.shape[2]), context.trimul_chunks,
            context.trimul_recompute, **self.op_weights())


class _ShardedTriangleAttention(TriangleAttention):
    def transpose(self, z: torch.Tensor) -> torch.Tensor:
        return transpose_pair(z, self.cp_context.sharding(z.shape[2]))


class _RingAttentionCore(GatedAttention):
    """Triangle attention's core: this rank's slices, the bias rows passed around the ring."""

    def attention(self, q, k, v, bias, mask):
        return ring_triangle_attention(q, k, v, bias, mask, self.cp_context.sharding(q.shape[3]))


class _QueryShardedAttentionCore(GatedAttention):
    """The single track's core: q, k, v on every rank, the bias rows of this rank's queries only.

    Each rank runs its queries, the outputs are gathered, and the gradients of q, k, v (each
    rank's part) are summed, so that the single track stays replicated."""

    def attention(self, q, k, v, bias, mask):
        sharding = self.cp_context.sharding(q.shape[3])
        q, k, v = sum_gradients(sharding, q, k, v)
        o = triangle_attention_rows(q[:, :, :, sharding.local_rows], k, v, bias, mask)
        return gather_rows(o, 3, sharding)


# (module type, parent type or None for any) -> the sharded class that replaces it.
_SHARDED = {
    (TriangleMultiplication, None): _ShardedTriangleMultiplication,
    (TriangleAttention, None): _ShardedTriangleAttention,
    (GatedAttention, TriangleAttention): _RingAttentionCore,
    (GatedAttention, AttentionPairBias): _QueryShardedAttentionCore,
}


def _sharded_copy(module: nn.Module, context: _Context, parent: Optional[type] = None) -> nn.Module:
    """A copy of the module tree sharing every parameter and buffer, sharded classes swapped in."""
    for (kind, parent_kind), sharded in _SHARDED.items():
        if isinstance(module, kind) and parent_kind in (None, parent) and type(module) is not kind:
            raise TypeError(f"ContextParallel supports {kind.__name__} itself, not the subclass "
                            f"{type(module).__name__} (its overrides would be lost)")
    clone = copy.copy(module)
    clone._modules = {name: _sharded_copy(child, context, type(module))
                      for name, child in module._modules.items()}
    sharded = _SHARDED.get((type(module), parent)) or _SHARDED.get((type(module), None))
    if sharded is not None:
        clone.__class__ = sharded
        clone.cp_context = context
    return clone


def _row_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters applied to rows of z (the pair track, and the single track's bias from z),
    in module order: on each rank their gradients are sums over its own rows only."""
    found: dict[int, nn.Parameter] = {}
    for m in module.modules():
        if isinstance(m, PairStack):
            found.update((id(p), p) for p in m.parameters())
        elif isinstance(m, AttentionPairBias):
            found.update((id(p), p) for part in (m.layer_norm_z, m.linear_z)
                         for p in part.parameters())
    return list(found.values())


class ContextParallel(nn.Module):
    """Runs `model` (a PairFormer or PairFormerBlock) with its pair representation sharded by rows.

    Every rank of `group` (the default group when None) builds the same model and calls forward
    together with its own rows: s [B, n_padded, c_s] (or None) and single_mask [B, n_padded] on
    every rank, z [B, n_local, n_padded, c_z] and pair_mask [B, n_local, n_padded] this rank's rows
    (shard() makes them from full tensors, padding masked). Returns (s, z) likewise. The model's
    parameters are shared, not copied; its backend choice does not matter here (the attention runs
    on the tpfkit op, the triangle multiplication on PyTorch with a sharded contraction).
    trimul_chunks: channel groups of the contraction, so its all-to-alls overlap the products.
    trimul_recompute: the triangle multiplication keeps what the fused op keeps and recomputes its
    row-local stages in the backward; False keeps their activations (faster, more memory).
    """

    def __init__(self, model: nn.Module, group: Optional[dist.ProcessGroup] = None, *,
                 trimul_chunks: int = 4, trimul_recompute: bool = True):
        super().__init__()
        if not isinstance(model, (PairFormer, PairFormerBlock)):
            raise TypeError(f"model must be a tpfkit.nn PairFormer or PairFormerBlock, "
                            f"got {type(model).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized (init_process_group) first")
        if trimul_chunks < 1:
            raise ValueError(f"trimul_chunks must be at least 1, got {trimul_chunks}")
        self.group = group
        self.context = _Context(group, dist.get_world_size(group), dist.get_rank(group),
                                trimul_chunks, trimul_recompute)
        self.module = _sharded_copy(model, self.context)
        self._row_parameters = _row_parameters(self.module)

    def sharding(self, n: int) -> RowSharding:
        """The row sharding of n tokens over this wrapper's group."""
        return RowSharding(n, self.context.world, self.context.rank, self.group)

    def shard(self, z: torch.Tensor, pair_mask: Optional[torch.Tensor] = None,
              s: Optional[torch.Tensor] = None, single_mask: Optional[torch.Tensor] = None):
        """forward's arguments (s, z, single_mask, pair_mask) for this rank from full tensors.

        z [B, N, N, c_z], pair_mask bool [B, N, N], s [B, N, c_s], single_mask bool [B, N]; a
        missing mask means every real token; padding up to n_padded is masked."""
        B, N = z.shape[0], z.shape[1]
        sharding = self.sharding(N)
        pad = sharding.n_padded - N
        if single_mask is None:
            single_mask = torch.ones((B, N), dtype=torch.bool, device=z.device)
        if single_mask.dtype != torch.bool:
            raise TypeError(f"single_mask must be a bool tensor, got {single_mask.dtype}")
        if tuple(single_mask.shape) != (B, N):
            raise ValueError(f"single_mask must have shape [B, N] = {[B, N]}, "
                             f"got {list(single_mask.shape)}")
        single_mask = nn.functional.pad(single_mask, (0, pad), value=False)
        if s is not None:
            if s.dim() != 3 or tuple(s.shape[:2]) != (B, N):
                raise ValueError(f"s must have shape [B, N, c_s] = [{B}, {N}, c_s], "
                                 f"got {list(s.shape)}")
            s = nn.functional.pad(s, (0, 0, 0, pad))
        return (s, sharding.shard_pair(z), single_mask,
                sharding.shard_mask(pair_mask, B, z.device))

    def forward(self, s: Optional[torch.Tensor], z: torch.Tensor,
                single_mask: Optional[torch.Tensor] = None,
                pair_mask: Optional[torch.Tensor] = None):
        """Masks are required: they are what keeps the padding out of every real token."""
        self.context.sharding(z.shape[2]).check_local(z, "z")
        if pair_mask is None or (s is not None and single_mask is None):
            raise ValueError("pair_mask (and single_mask with s) must be given: they mask the "
                             "padding up to a multiple of the rank count (shard() makes them)")
        if pair_mask.dtype != torch.bool:
            raise TypeError(f"pair_mask must be a bool tensor, got {pair_mask.dtype}")
        if tuple(pair_mask.shape) != tuple(z.shape[:3]):
            raise ValueError(f"pair_mask must have z's shape without channels {list(z.shape[:3])}, "
                             f"got {list(pair_mask.shape)}")
        return self.module(s, z, single_mask, pair_mask)

    def gather(self, s: Optional[torch.Tensor], z: torch.Tensor, n: int):
        """Full, unpadded outputs on every rank: s [B, n, c_s] (or None), z [B, n, n, c_z].

        For reading results; it carries no gradient."""
        return (None if s is None else s[:, :n].detach()), self.sharding(n).gather_pair(z)

    def all_reduce_gradients(self) -> None:
        """Sums the gradients of the parameters applied to rows of z over the ranks (one
        all-reduce per dtype); the single track's are whole on every rank already."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self._row_parameters:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                by_dtype.setdefault(p.grad.dtype, []).append(p)
        for params in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
