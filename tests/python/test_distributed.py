"""Context parallelism on CPU: 2, 3, 4 and 8 gloo ranks (spawned here) against the single-process result.

The ranks run distributed_checks.py (one process group per world size, all checks in it); each
check is reported as its own test. The row-sharding arithmetic is tested in this process.
"""
from __future__ import annotations

import pytest
import torch

from distributed_checks import CHECKS, failures_of, run_ranks
from seeds import seed_for
from tpfkit.distributed import RowSharding

WORLDS = (2, 3, 4, 8)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w}ranks")
def rank_results(request, tmp_path_factory):
    seed = seed_for(f"{request.node.nodeid}::{request.param}ranks")
    return request.param, *run_ranks(request.param, tmp_path_factory.mktemp("ranks"), seed)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_multi_rank(rank_results, check):
    failures = failures_of(check, *rank_results[:2], rank_results[2])
    assert not failures, failures


@pytest.mark.parametrize("n,world", [(1, 1), (7, 2), (9, 3), (12, 3), (2, 3), (128, 8)])
def test_row_sharding_layout(n, world, seed):
    z = torch.randn((2, n, n, 3))
    mask = torch.rand((2, n, n)) > 0.5
    shards = [RowSharding(n, world, r) for r in range(world)]
    n_padded = shards[0].n_padded
    assert n_padded % world == 0 and n <= n_padded < n + world
    rows = [s.local_rows for s in shards]
    assert [r.start for r in rows] == [i * n_padded // world for i in range(world)]
    local = [s.shard_pair(z) for s in shards]
    assert all(tuple(t.shape) == (2, n_padded // world, n_padded, 3) for t in local)
    joined = torch.cat(local, dim=1)
    assert torch.equal(joined[:, :n, :n], z)
    assert not joined[:, n:].any() and not joined[:, :, n:].any(), "padding must be zeros"
    masks = torch.cat([s.shard_mask(mask, 2) for s in shards], dim=1)
    assert torch.equal(masks[:, :n, :n], mask)
    assert not masks[:, n:].any() and not masks[:, :, n:].any()
    assert torch.equal(torch.cat([s.unpad_pair(t) for s, t in zip(shards, local)], dim=1), z)
    all_real = torch.cat([s.shard_mask(None, 2) for s in shards], dim=1)
    assert all_real[:, :n, :n].all() and all_real.sum() == 2 * n * n


@pytest.mark.parametrize("channels,world", [(7, 3), (128, 2), (2, 3), (12, 4)])
def test_channel_ranges(channels, world):
    ranges = RowSharding(5, world, 0).channel_ranges(channels)
    assert ranges[0][0] == 0 and ranges[-1][1] == channels
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    widths = [b - a for a, b in ranges]
    assert max(widths) - min(widths) <= 1 and widths == sorted(widths, reverse=True)


def test_row_sharding_rejects_bad_arguments():
    with pytest.raises(ValueError, match="tokens"):
        RowSharding(0, 2, 0)
    with pytest.raises(ValueError, match="rank"):
        RowSharding(4, 2, 2)
    with pytest.raises(ValueError, match="z must have shape"):
        RowSharding(4, 2, 0).shard_pair(torch.zeros(1, 3, 4, 2))
    with pytest.raises(TypeError, match="mask must be a bool"):
        RowSharding(4, 2, 0).shard_mask(torch.zeros(1, 4, 4), 1)
