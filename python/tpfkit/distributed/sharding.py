"""Row sharding of an N x N pair tensor over the ranks of a process group.

Rank p of P holds rows [p * n_local, (p + 1) * n_local) of the pair tensor padded to n_padded tokens
(the smallest multiple of P that is at least N), with every column: z [B, n_local, n_padded, C], the
pair mask [B, n_local, n_padded]. Equal shards keep every all-to-all a plain exchange of equal
blocks; padded rows and columns are masked, so they never reach a real position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["RowSharding"]


@dataclass(frozen=True)
class RowSharding:
    """Which rows of an N-token pair tensor each of the `world` ranks of `group` holds."""

    n: int
    world: int
    rank: int
    group: Optional[dist.ProcessGroup] = None

    @classmethod
    def of(cls, n: int, group: Optional[dist.ProcessGroup] = None) -> "RowSharding":
        """The sharding of n tokens over `group` (None: the default group), seen from this rank."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized (init_process_group) first")
        return cls(n, dist.get_world_size(group), dist.get_rank(group), group)

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n (tokens) must be at least 1, got {self.n}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, world) = [0, {self.world}), got {self.rank}")

    @property
    def n_padded(self) -> int:
        return -(-self.n // self.world) * self.world

    @property
    def n_local(self) -> int:
        return self.n_padded // self.world

    def rows(self, rank: int) -> slice:
        """The padded rows that `rank` holds."""
        return slice(rank * self.n_local, (rank + 1) * self.n_local)

    @property
    def local_rows(self) -> slice:
        return self.rows(self.rank)

    def channel_ranges(self, channels: int) -> list[tuple[int, int]]:
        """[start, stop) of the channels each rank holds when a tensor is sharded by channel.

        The first channels % world ranks take one channel more: c_z need not divide by P."""
        base, extra = divmod(channels, self.world)
        ranges, start = [], 0
        for r in range(self.world):
            stop = start + base + (r < extra)
            ranges.append((start, stop))
            start = stop
        return ranges

    # Moving whole tensors in and out of the sharded layout.

    def shard_pair(self, z: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full pair tensor [B, N, N, ...], padded with zeros (False for
        bool): [B, n_local, n_padded, ...]."""
        self._check_pair(z, "z")
        rows = self.local_rows
        z = z[:, rows.start:min(rows.stop, self.n)]
        return _pad_dims(z, (1, 2), (self.n_local, self.n_padded))

    def shard_mask(self, mask: Optional[torch.Tensor], batch: int,
                   device: Optional[torch.device] = None) -> torch.Tensor:
        """This rank's rows of a bool pair mask [B, N, N] (None: every real pair), padding False."""
        if mask is None:
            mask = torch.ones((batch, self.n, self.n), dtype=torch.bool, device=device)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
        if mask.dim() != 3:
            raise ValueError(f"mask must have shape [B, N, N], got {list(mask.shape)}")
        return self.shard_pair(mask)

    def unpad_pair(self, z_local: torch.Tensor) -> torch.Tensor:
        """The real (unpadded) part of this rank's rows: [B, rows kept, N, ...]."""
        rows = self.local_rows
        return z_local[:, :max(0, min(rows.stop, self.n) - rows.start), :self.n]

    def gather_pair(self, z_local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows put together, padding removed: [B, N, N, ...] on every rank.

        For reading results (tests, inference); it carries no gradient."""
        self.check_local(z_local, "z_local")
        with torch.no_grad():
            parts = [torch.empty_like(z_local) for _ in range(self.world)]
            dist.all_gather(parts, z_local.contiguous(), group=self.group)
            return torch.cat(parts, dim=1)[:, :self.n, :self.n]

    def _check_pair(self, z: torch.Tensor, name: str) -> None:
        if z.dim() < 3 or z.shape[1] != self.n or z.shape[2] != self.n:
            raise ValueError(f"{name} must have shape [B, N, N, ...] with N = {self.n}, "
                             f"got {list(z.shape)}")

    def check_local(self, z: torch.Tensor, name: str) -> None:
        if z.dim() < 3 or z.shape[1] != self.n_local or z.shape[2] != self.n_padded:
            raise ValueError(f"{name} must have shape [B, n_local, n_padded, ...] = "
                             f"[B, {self.n_local}, {self.n_padded}, ...], got {list(z.shape)}")


def _pad_dims(x: torch.Tensor, dims: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """x zero-padded at the end of `dims` up to `sizes` (False for bool tensors)."""
    pad = [0] * (2 * x.dim())
    for d, size in zip(dims, sizes):
        pad[2 * (x.dim() - 1 - d) + 1] = size - x.shape[d]
    if not any(pad):
        return x
    if x.dtype == torch.bool:
        return F.pad(x.to(torch.uint8), pad).bool()
    return F.pad(x, pad)
