"""The exchanges of the row-sharded layout, as autograd-aware functions.

- `transpose_pair`: rows of z -> rows of z^T (one all-to-all of n_local x n_local blocks); it is its
  own inverse, and so is its backward.
- `rows_to_channels_async` / `channels_to_rows_async`: row sharding <-> channel sharding (each rank
  all rows of its channels), the layout of the triangle multiplication's contraction.
- `gather_rows` / `sum_gradients`: into and out of a replicated computation (the single track's
  attention: every rank holds s, runs its own queries and gathers the outputs).
- `Ring`: the neighbour exchange of the bias ring (async isend/irecv, so a transfer runs while the
  caller computes).

All of them work on any backend torch.distributed offers (NCCL on GPUs, gloo on CPUs). Every
exchange but sum_gradients' all-reduce is a fixed permutation of data, and an all-reduce gives the
same bits on every rank and in every run of a fixed group, so results are deterministic.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from tpfkit.distributed.sharding import RowSharding

__all__ = ["transpose_pair", "gather_rows", "sum_gradients", "rows_to_channels_async",
           "channels_to_rows_async", "Ring", "all_to_all_async"]


class Pending:
    """A transfer in flight: wait() returns its result once the transfer has landed."""

    def __init__(self, works: Sequence[dist.Work], result, keep: Sequence[torch.Tensor] = ()):
        self._works = list(works)
        self._result = result
        self._keep = list(keep)  # buffers the transfer reads: they must outlive it

    def wait(self):
        for w in self._works:
            w.wait()
        self._works, self._keep = [], []
        return self._result


def all_to_all_async(parts: Sequence[Sequence[torch.Tensor]],
                     recv_shapes: Sequence[Sequence[tuple[int, ...]]],
                     sharding: RowSharding) -> Pending:
    """Sends the tensors parts[r] to rank r and receives tensors of recv_shapes[r] from rank r.

    One all-to-all carries them all; Pending.wait() gives, per source rank, the list of received
    tensors (views of one buffer). Bool tensors travel as bytes (not every backend carries bool)."""
    ref = parts[sharding.rank][0]
    wire = torch.uint8 if ref.dtype == torch.bool else ref.dtype
    send_sizes = [sum(t.numel() for t in ts) for ts in parts]
    send = torch.empty(sum(send_sizes), dtype=wire, device=ref.device)
    offset = 0
    for ts in parts:
        for t in ts:
            send[offset:offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
    recv_sizes = [[math.prod(s) for s in shapes] for shapes in recv_shapes]
    recv = send.new_empty(sum(map(sum, recv_sizes)))
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=[sum(s) for s in recv_sizes], input_split_sizes=send_sizes,
        group=sharding.group, async_op=True)
    received, offset = [], 0
    for shapes, sizes in zip(recv_shapes, recv_sizes):
        views = []
        for shape, size in zip(shapes, sizes):
            views.append(recv[offset:offset + size].view(shape).view(ref.dtype))
            offset += size
        received.append(views)
    return Pending([work], received, keep=[send])


def _transpose_blocks(x: torch.Tensor, sharding: RowSharding) -> torch.Tensor:
    """Row-sharded x -> row-sharded x^T (dims 1 and 2 swapped globally), no autograd."""
    parts = [x[:, :, sharding.rows(r)].transpose(1, 2) for r in range(sharding.world)]
    # The block from rank p is x[rows I_p, columns I_mine], transposed by p:
    # [B, n (mine), n (p's), ...].
    received = all_to_all_async([[p] for p in parts], [[parts[0].shape]] * sharding.world,
                                sharding).wait()
    return torch.cat([r[0] for r in received], dim=2)


class _TransposePair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sharding):
        ctx.sharding = sharding
        return _transpose_blocks(x, sharding)

    @staticmethod
    def backward(ctx, grad):
        return _transpose_blocks(grad, ctx.sharding), None


def transpose_pair(x: torch.Tensor, sharding: RowSharding) -> torch.Tensor:
    """Rows of x^T from rows of x: [B, n_local, n_padded, ...] -> same shape, x[i, j] -> x[j, i].

    Bool tensors (masks) work too; gradients flow back through the same exchange."""
    sharding.check_local(x, "x")
    return _TransposePair.apply(x, sharding)


def rows_to_channels_async(tensors: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int]],
                           sharding: RowSharding) -> Pending:
    """Starts moving row-sharded tensors [B, n_local, n_padded, C] to channel sharding.

    Rank r gets channels ranges[r] of every row. Pending.wait() gives, per source rank, its rows
    of each tensor as channels-first blocks [B, c_mine, n_local, n_padded] (concatenate them along
    dim 2 for the full [B, c_mine, n_padded, n_padded])."""
    B, n, N = tensors[0].shape[0], sharding.n_local, sharding.n_padded
    lo, hi = ranges[sharding.rank]
    parts = [[t[..., a:b].permute(0, 3, 1, 2) for t in tensors] for a, b in ranges]
    return all_to_all_async(parts, [[(B, hi - lo, n, N)] * len(tensors)] * sharding.world, sharding)


def channels_to_rows_async(tensors: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int]],
                           sharding: RowSharding) -> Pending:
    """Starts the way back: channels-first [B, c_mine, n_padded, n_padded] -> row sharding.

    Pending.wait() gives, per source rank r, this rank's rows of r's channels ranges[r] of each
    tensor as [B, c_r, n_local, n_padded] blocks."""
    B, n, N = tensors[0].shape[0], sharding.n_local, sharding.n_padded
    parts = [[t[:, :, sharding.rows(r)] for t in tensors] for r in range(sharding.world)]
    return all_to_all_async(parts, [[(B, b - a, n, N)] * len(tensors) for a, b in ranges], sharding)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sharding):
        ctx.dim, ctx.sharding = dim, sharding
        parts = [torch.empty_like(x) for _ in range(sharding.world)]
        dist.all_gather(parts, x.contiguous(), group=sharding.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        sharding = ctx.sharding
        return grad.narrow(ctx.dim, sharding.rank * sharding.n_local, sharding.n_local), None, None


def gather_rows(x: torch.Tensor, dim: int, sharding: RowSharding) -> torch.Tensor:
    """Every rank's block of n_local rows along `dim`, concatenated in rank order (n_padded rows).

    The result is replicated: every rank computes the same thing from it and so holds the same
    gradient, of which the backward keeps this rank's rows."""
    if x.shape[dim] != sharding.n_local:
        raise ValueError(f"x must have n_local = {sharding.n_local} rows in dimension {dim}, "
                         f"got {list(x.shape)}")
    return _GatherRows.apply(x, dim, sharding)


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sharding, *xs):
        ctx.sharding = sharding
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.clone(memory_format=torch.contiguous_format) for g in grads]  # never in place
        for g in grads:
            dist.all_reduce(g, group=ctx.sharding.group)
        return (None, *grads)


def sum_gradients(sharding: RowSharding, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """xs unchanged; in the backward their gradients are summed over the ranks.

    For replicated tensors (the same on every rank) that each rank uses for its own part of a
    computation, so that each rank's gradient is partial."""
    return _SumGradients.apply(sharding, *xs)


class Ring:
    """Neighbour exchange around the ranks: each rank sends to rank + 1 and receives from rank - 1.

    shift(x) starts the transfer and returns at once; the caller computes meanwhile and calls
    wait() on the result for the left neighbour's tensor. Each kind of message travels under its
    own tag, so transfers of equal shapes in flight together never swap."""

    def __init__(self, sharding: RowSharding):
        self.sharding = sharding
        self.right = (sharding.rank + 1) % sharding.world
        self.left = (sharding.rank - 1) % sharding.world

    def shift(self, x: torch.Tensor, tag: int) -> Pending:
        if self.sharding.world == 1:
            return Pending([], x)
        x = x.contiguous()
        recv = torch.empty_like(x)
        group = self.sharding.group
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, group=group, tag=tag, group_peer=self.right),
            dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=self.left),
        ])
        return Pending(works, recv, keep=[x])
