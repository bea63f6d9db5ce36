"""Triangle attention on row-sharded slices: the bias ring.

Starting node: the slices are rows of z, so q, k, v of this rank's slices are local, but the bias
b[h, j, k] of query j comes from row j of z, which rank owner(j) holds. The bias row blocks travel
around the ring; at each step a rank runs its slices' queries j in the block it holds against all
keys (`triangle_attention_rows`'s kernel), so every softmax is exact and nothing needs merging.
The block for the next step arrives while the current one computes.

Backward: the blocks go round again, and the bias gradient of a block is accumulated along the
ring in a fixed order (the owner's contribution first, then each next rank's), reaching its owner
after P hops: deterministic, with no all-reduce of a full N x N bias gradient.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpfkit.distributed.collectives import Ring
from tpfkit.distributed.sharding import RowSharding
from tpfkit.ops._common import inner_contiguous, load_named, save_named

__all__ = ["ring_triangle_attention"]

_BIAS_TAG, _BIAS_GRAD_TAG = 1, 2


def _attention_fwd(q, k, v, bias, mask, scale, keep_residual):
    return torch.ops.tpfkit.triangle_attention_fwd(
        q, k, v, bias, mask, scale, keep_residual)


def _attention_bwd(grad_o, q, k, v, bias, mask, o, lse, residual, scale):
    return torch.ops.tpfkit.triangle_attention_bwd(
        grad_o, q, k, v, bias, mask, o, lse, residual, scale)


def _query_rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Queries `rows` of a [B, n, H, S, ...] tensor (an empty residual passes as it is)."""
    return x[:, :, :, rows] if x.numel() else x


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, mask, scale, keep_residual, sharding):
        ring = Ring(sharding)
        outputs = None  # o, lse, residual of all query rows, shaped and typed as the op's
        block = bias.contiguous()
        for step in range(sharding.world):
            rows = sharding.rows((sharding.rank - step) % sharding.world)
            incoming = ring.shift(block, _BIAS_TAG) if step + 1 < sharding.world else None
            blocks = _attention_fwd(_query_rows(q, rows), k, v, block, mask, scale, keep_residual)
            if outputs is None:
                outputs = [x.new_empty(x.shape[:3] + q.shape[3:4] + x.shape[4:]) if x.numel()
                           else x for x in blocks]
            for full, part in zip(outputs, blocks):
                if part.numel():
                    full[:, :, :, rows] = part
            if incoming is not None:
                block = incoming.wait()
        o, lse, residual = outputs
        save_named(ctx, q=q, k=k, v=v, bias=bias, mask=mask, o=o, lse=lse, residual=residual)
        ctx.scale, ctx.sharding = scale, sharding
        return o

    @staticmethod
    def backward(ctx, grad_o):
        s = load_named(ctx)
        sharding = ctx.sharding
        ring = Ring(sharding)
        grad_o = inner_contiguous(grad_o)
        dq = torch.empty_like(s.q)
        dk = dv = None
        block = s.bias.contiguous()
        partial_sum = None
        for step in range(sharding.world):
            rows = sharding.rows((sharding.rank - step) % sharding.world)
            incoming = ring.shift(block, _BIAS_TAG) if step + 1 < sharding.world else None
            dq_r, dk_r, dv_r, dbias_r = _attention_bwd(
                _query_rows(grad_o, rows), _query_rows(s.q, rows), s.k, s.v, block, s.mask,
                _query_rows(s.o, rows), _query_rows(s.lse, rows), _query_rows(s.residual, rows),
                ctx.scale)
            dq[:, :, :, rows] = dq_r
            dk = dk_r if dk is None else dk.add_(dk_r)
            dv = dv_r if dv is None else dv.add_(dv_r)
            # The block's gradient so far (its owner's part first, then each rank's after it) plus
            # this rank's part, handed on: after P hops the sum reaches the block's owner.
            if partial_sum is not None:
                dbias_r = partial_sum.wait().add_(dbias_r)
            partial_sum = ring.shift(dbias_r, _BIAS_GRAD_TAG)
            if incoming is not None:
                block = incoming.wait()
        dbias = partial_sum.wait()
        return dq, dk, dv, dbias, None, None, None, None


def ring_triangle_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    sharding: RowSharding,
    scale: Optional[float] = None,
    *,
    residual: bool = True,
) -> torch.Tensor:
    """Starting-node triangle attention of this rank's slices, with the bias rows spread over ranks.

    q, k, v: [B, n_local, H, n_padded, D], this rank's slices (rows of z) over all tokens;
    bias: [B, H, n_local, n_padded], the bias rows of this rank's tokens (rows of z as queries);
    mask: bool [B, n_local, n_padded] (True = attend) or None.
    Returns o [B, n_local, H, n_padded, D]: this rank's slices of triangle_attention(q, k, v,
    bias, mask) over the full tensors. Autograd for q, k, v and bias; collective: every rank of
    sharding.group must call it together.
    """
    B, n, N = q.shape[0] if q.dim() == 5 else -1, sharding.n_local, sharding.n_padded
    if q.dim() != 5 or q.shape[1] != n or q.shape[3] != N:
        raise ValueError(f"q must have shape [B, n_local, H, n_padded, D] = [B, {n}, H, {N}, D], "
                         f"got {list(q.shape)}")
    H, D = q.shape[2], q.shape[4]
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {list(q.shape)}, got {list(x.shape)}")
    if tuple(bias.shape) != (B, H, n, N):
        raise ValueError(f"bias must have shape [B, H, n_local, n_padded] = {[B, H, n, N]}, "
                         f"got {list(bias.shape)}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
        if tuple(mask.shape) != (B, n, N):
            raise ValueError(f"mask must have shape [B, n_local, n_padded] = {[B, n, N]}, "
                             f"got {list(mask.shape)}")
        mask = inner_contiguous(mask)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not math.isfinite(scale) or scale == 0:
        raise ValueError(f"scale must be a finite nonzero number, got {scale}")
    return _RingAttention.apply(inner_contiguous(q), inner_contiguous(k), inner_contiguous(v),
                                bias, mask, float(scale), bool(residual), sharding)
