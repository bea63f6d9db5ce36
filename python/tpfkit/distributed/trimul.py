"""The triangle multiplicative update on row-sharded x: its contraction through channel sharding.

Outgoing x[i, j, c] = sum_k a[i, k, c] b[j, k, c]; incoming x[i, j, c] = sum_k a[k, i, c] b[k, j, c]
Each channel is an independent N x N matrix product, so an all-to-all hands every rank all rows of
its C/P channels, it multiplies them locally, and an all-to-all brings the rows back. The channels
go in `chunks` groups: the exchange of the next group runs while the current group multiplies (and
the return of the previous group), in the forward and in the backward. The rest of the update
(LayerNorms, projections, gates) is row-local.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpfkit.distributed.collectives import (
    channels_to_rows_async,
    rows_to_channels_async,
)
from tpfkit.distributed.sharding import RowSharding
from tpfkit.ops.torch_reference import triangle_multiplicative_update_torch

__all__ = ["sharded_triangle_contraction", "sharded_triangle_multiplicative_update"]

DIRECTIONS = ("outgoing", "incoming")


def _channel_pieces(channels: int, chunks: int,
                    sharding: RowSharding) -> list[list[tuple[int, int]]]:
    """pieces[c][r]: the [start, stop) channels of rank r's chunk c."""
    pieces = [[] for _ in range(chunks)]
    for start, stop in sharding.channel_ranges(channels):
        width = stop - start
        for c in range(chunks):
            pieces[c].append((start + width * c // chunks, start + width * (c + 1) // chunks))
    return pieces


def _gather_rows(received, index: int) -> torch.Tensor:
    """Tensor `index` of every source rank's blocks, stacked along the rows: [B, c, N, N]."""
    return torch.cat([blocks[index] for blocks in received], dim=2)


def _scatter_channels(outs, received, pieces) -> None:
    """Writes the returned blocks [B, c, n, N] of every rank's chunk into the rows [B, n, N, C]."""
    for (lo, hi), blocks in zip(pieces, received):
        for out, block in zip(outs, blocks):
            out[..., lo:hi] = block.permute(0, 2, 3, 1)


def _contract(a: torch.Tensor, b: torch.Tensor, outgoing: bool) -> torch.Tensor:
    return a @ b.transpose(-1, -2) if outgoing else a.transpose(-1, -2) @ b


def _contraction_forward(a, b, outgoing, pieces, sharding):
    """x and the channel-sharded a, b blocks its backward needs."""
    arriving = [rows_to_channels_async((a, b), p, sharding) for p in pieces]
    returning, saved = [], []
    for c, p in enumerate(pieces):
        received = arriving[c].wait()
        a_c, b_c = _gather_rows(received, 0), _gather_rows(received, 1)
        saved += [a_c, b_c]
        returning.append(channels_to_rows_async((_contract(a_c, b_c, outgoing),), p, sharding))
    x = a.new_empty(a.shape)
    for c, p in enumerate(pieces):
        _scatter_channels((x,), returning[c].wait(), p)
    return x, saved


def _contraction_backward(grad_x, saved, outgoing, pieces, sharding):
    arriving = [rows_to_channels_async((grad_x,), p, sharding) for p in pieces]
    returning = []
    for c, p in enumerate(pieces):
        a_c, b_c = saved[2 * c], saved[2 * c + 1]
        dx = _gather_rows(arriving[c].wait(), 0)
        if outgoing:
            da, db = dx @ b_c, dx.transpose(-1, -2) @ a_c
        else:
            da, db = b_c @ dx.transpose(-1, -2), a_c @ dx
        returning.append(channels_to_rows_async((da, db), p, sharding))
    da = grad_x.new_empty(grad_x.shape)
    db = grad_x.new_empty(grad_x.shape)
    for c, p in enumerate(pieces):
        _scatter_channels((da, db), returning[c].wait(), p)
    return da, db


class _ShardedContraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, outgoing, pieces, sharding, done):
        # done: (x, saved) of an earlier forward on the same a and b, which a recomputation
        # replays instead of running the products and the exchanges again.
        x, saved = done if done is not None else _contraction_forward(a, b, outgoing, pieces,
                                                                       sharding)
        ctx.save_for_backward(*saved)
        ctx.outgoing, ctx.pieces, ctx.sharding = outgoing, pieces, sharding
        return x.detach() if done is not None else x

    @staticmethod
    def backward(ctx, grad_x):
        da, db = _contraction_backward(grad_x.contiguous(), ctx.saved_tensors, ctx.outgoing,
                                       ctx.pieces, ctx.sharding)
        return da, db, None, None, None, None


def _check_contraction(a, b, direction, sharding, chunks) -> list[list[tuple[int, int]]]:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'outgoing' or 'incoming', got {direction!r}")
    sharding.check_local(a, "a")
    if a.dim() != 4:
        raise ValueError(f"a must have shape [B, n_local, n_padded, C], got {list(a.shape)}")
    if tuple(b.shape) != tuple(a.shape):
        raise ValueError(f"b must have a's shape {list(a.shape)}, got {list(b.shape)}")
    if b.dtype != a.dtype or b.device != a.device:
        raise ValueError(f"b must have a's dtype {a.dtype} and device {a.device}, "
                         f"got {b.dtype} on {b.device}")
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    chunks = max(1, min(chunks, a.shape[-1] // sharding.world))
    return _channel_pieces(a.shape[-1], chunks, sharding)


def sharded_triangle_contraction(a: torch.Tensor, b: torch.Tensor, direction: str,
                                 sharding: RowSharding, chunks: int = 4) -> torch.Tensor:
    """The triangle multiplication's contraction of row-sharded a, b [B, n_local, n_padded, C].

    Returns this rank's rows of x [B, n_local, n_padded, C], x[i, j] = sum_k a[i, k] * b[j, k]
    ("outgoing") or sum_k a[k, i] * b[k, j] ("incoming"), channel by channel, over the full
    tensors. Autograd for a and b; collective over sharding.group. `chunks`: channel groups
    pipelined so that communication overlaps the products (at most C // P are used)."""
    pieces = _check_contraction(a, b, direction, sharding, chunks)
    return _ShardedContraction.apply(a, b, direction == "outgoing", pieces, sharding, None)


class _ShardedTrimul(torch.autograd.Function):
    """The whole triangle multiplicative update keeping what the fused op keeps: x, the contraction
    result and the channel-sharded a, b. The row-local stages (LayerNorms, projections, gates) run
    again in the backward instead of keeping their activations; the contraction is not redone."""

    @staticmethod
    def forward(ctx, x, mask, direction, chunks, sharding, names, *weights):
        done = {}

        def contract(a, b, direction):
            pieces = _check_contraction(a, b, direction, sharding, chunks)
            done["pieces"] = pieces
            done["x"], done["saved"] = _contraction_forward(a, b, direction == "outgoing", pieces,
                                                            sharding)
            return done["x"]

        y = triangle_multiplicative_update_torch(x, direction, mask, **dict(zip(names, weights)),
                                                 contract=contract)
        ctx.save_for_backward(x, mask, done["x"], *done["saved"], *weights)
        ctx.n_saved = len(done["saved"])
        ctx.direction, ctx.pieces, ctx.names = direction, done["pieces"], names
        ctx.sharding = sharding
        ctx.autocast = _autocast_state(x)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, mask, z, *rest = ctx.saved_tensors
        saved, weights = rest[:ctx.n_saved], rest[ctx.n_saved:]
        outgoing = ctx.direction == "outgoing"

        def replay(a, b, direction):
            return _ShardedContraction.apply(a, b, outgoing, ctx.pieces, ctx.sharding, (z, saved))

        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[6:])
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            leaves = [t.detach().requires_grad_(need) for t, need in zip((x, *weights), needs)]
            y = triangle_multiplicative_update_torch(
                leaves[0], ctx.direction, mask, **dict(zip(ctx.names, leaves[1:])),
                contract=replay)
        grads = iter(torch.autograd.grad(y, [t for t in leaves if t.requires_grad], grad_y))
        x_grad, *weight_grads = (next(grads) if t.requires_grad else None for t in leaves)
        return (x_grad, None, None, None, None, None, *weight_grads)


def _autocast_state(x: torch.Tensor) -> dict:
    kind = x.device.type
    return dict(device_type=kind, enabled=torch.is_autocast_enabled(kind),
                dtype=torch.get_autocast_dtype(kind))


def sharded_triangle_multiplicative_update(x: torch.Tensor, direction: str,
                                           mask: Optional[torch.Tensor], sharding: RowSharding,
                                           chunks: int = 4, recompute: bool = True,
                                           **weights: torch.Tensor) -> torch.Tensor:
    """triangle_multiplicative_update (cuEquivariance's arguments) on this rank's rows of x
    [B, n_local, n_padded, D], mask [B, n_local, n_padded]; returns this rank's rows of y.

    recompute: keep what the fused op keeps (x, z and the channel-sharded a, b) and run the
    row-local stages again in the backward; False keeps their activations instead (faster
    backward, several times the memory). Collective over sharding.group."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'outgoing' or 'incoming', got {direction!r}")
    sharding.check_local(x, "x")
    if not recompute:
        def contract(a, b, direction):
            return sharded_triangle_contraction(a, b, direction, sharding, chunks)
        return triangle_multiplicative_update_torch(x, direction, mask, **weights,
                                                    contract=contract)
    names = tuple(weights)
    return _ShardedTrimul.apply(x, mask, direction, chunks, sharding, names, *weights.values())
