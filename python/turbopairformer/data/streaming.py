"""FoldPipe: record-store shards streamed from local files, HTTP(S) or S3 under a hard memory budget.

`StreamingDataset` is a torch IterableDataset. Each epoch has one deterministic order for
(seed, epoch); ranks take interleaved entries of it and DataLoader workers take batches of their
rank's list round-robin, which is the order DataLoader hands batches back in. So what one rank has
consumed is always a prefix of its list, and `state_dict(num_consumed)` resumes exactly after it,
with any number of workers. The memory budget (`cache_bytes`) is shared by the workers: each
worker's prefetcher gets `cache_bytes // num_workers`.
"""
from __future__ import annotations

import json
import os
import posixpath
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from turbopairformer import _C
from turbopairformer.data.pack import MANIFEST_FORMAT

STATE_VERSION = 1


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def _join(base: str, name: str) -> str:
    """`name` relative to the folder of `base` (a path or URL); absolute names are kept."""
    if "://" in name or os.path.isabs(name):
        return name
    if _is_url(base):
        scheme, rest = base.split("://", 1)
        return f"{scheme}://{posixpath.join(posixpath.dirname(rest), name)}"
    return os.path.join(os.path.dirname(base.removeprefix("file://")), name)


def read_manifest(location: str, **source_options: Any) -> dict:
    """The manifest `tpf pack` writes, read from a path or URL, with every shard's `location`
    resolved (its `url` when present, else its `path` relative to the manifest)."""
    raw = bytes(_C.stream_read_all(location, **source_options))
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"manifest {location!r} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"manifest {location!r}: expected a JSON object with "
                         f"format = {MANIFEST_FORMAT!r}")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        raise ValueError(f"manifest {location!r}: expected a non-empty list 'shards'")
    for i, s in enumerate(shards):
        name = s.get("url") or s.get("path")
        if not name:
            raise ValueError(f"manifest {location!r}: shards[{i}] has neither 'url' nor 'path'")
        s["location"] = _join(location, name)
    return manifest


def _shard_specs(source: str | Sequence[str] | dict, options: dict) -> tuple[list[str], list[int], list[int]]:
    if isinstance(source, dict):
        manifest = source
    elif isinstance(source, str) and source.endswith(".json"):
        manifest = read_manifest(source, **options)
    elif isinstance(source, str):
        return [source], [], []
    elif isinstance(source, Sequence) and source and all(isinstance(s, str) for s in source):
        return list(source), [], []
    else:
        raise ValueError(f"source: expected a manifest (.json path or URL, or its dict), a shard "
                         f"location or a list of them, got {source!r}")
    shards = manifest["shards"]
    return ([s["location"] for s in shards], [int(s.get("records", 0)) for s in shards],
            [int(s.get("bytes", 0)) for s in shards])


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class StreamingDataset(torch.utils.data.IterableDataset):
    """Records of record-store shards, streamed in a deterministic shuffled order.

    source: a manifest (path or URL of the JSON `tpf pack` writes, or its dict), one shard location
        or a list of them; locations are paths, file://, http(s):// or s3:// URLs.
    cache_bytes: hard limit on prefetched bytes held in memory, over all DataLoader workers.
    shuffle, seed: one permutation per (seed, epoch); block_size > 0 shuffles blocks of that many
        neighbouring records (and inside each block) for locality of range reads.
    rank, world_size: this process's share (default: torch.distributed, else RANK / WORLD_SIZE).
    drop_last: every rank gets the same count by dropping the tail (True) or repeating records (False).
    batch_size: the DataLoader's batch size, so that workers split the rank's list by whole batches.
    transform: applied to each record (a dict of numpy arrays) before it is yielded.
    disk_cache_dir, disk_cache_bytes: keep fetched bytes of remote shards on local disk (a folder
        per process under disk_cache_dir, the budget shared by the DataLoader workers), so later
        epochs read them locally.
    The remaining arguments tune the prefetcher and the sources (see include/tpf/stream.h).
    """

    def __init__(self, source: str | Sequence[str] | dict, cache_bytes: int = 256 << 20,
                 shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, *, block_size: int = 0, drop_last: bool = False,
                 batch_size: int = 1, transform: Callable[[dict], Any] | None = None,
                 max_inflight: int = 256, group_records: int = 0, coalesce_gap: int = 4 << 10,
                 max_request_bytes: int = 8 << 20, verify_checksums: bool = True,
                 disk_cache_dir: str | None = None, disk_cache_bytes: int = 0,
                 max_connections: int = 16, http_threads: int = 0,
                 connect_timeout_s: float = 10.0,
                 request_timeout_s: float = 60.0, stall_timeout_s: float = 15.0,
                 max_attempts: int = 8, backoff_base_s: float = 0.05, backoff_max_s: float = 2.0,
                 retry_deadline_s: float = 120.0):
        super().__init__()
        if cache_bytes <= 0:
            raise ValueError(f"cache_bytes: expected > 0, got {cache_bytes}")
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        if block_size < 0:
            raise ValueError(f"block_size: expected >= 0, got {block_size}")
        default_rank, default_world = _default_rank_world()
        self.rank = default_rank if rank is None else int(rank)
        self.world_size = default_world if world_size is None else int(world_size)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank, world_size: expected 0 <= rank < world_size, got "
                             f"rank={self.rank}, world_size={self.world_size}")
        self.cache_bytes = int(cache_bytes)
        self.shuffle, self.seed, self.block_size = bool(shuffle), int(seed), int(block_size)
        self.drop_last, self.batch_size, self.transform = bool(drop_last), int(batch_size), transform
        self.verify_checksums = bool(verify_checksums)
        if disk_cache_dir is not None and disk_cache_bytes <= 0:
            raise ValueError(f"disk_cache_bytes: expected > 0 with disk_cache_dir, got {disk_cache_bytes}")
        self.disk_cache_dir, self.disk_cache_bytes = disk_cache_dir, int(disk_cache_bytes)
        self._source_options = dict(max_connections=max_connections, http_threads=http_threads,
                                    connect_timeout_s=connect_timeout_s,
                                    request_timeout_s=request_timeout_s,
                                    stall_timeout_s=stall_timeout_s, max_attempts=max_attempts,
                                    backoff_base_s=backoff_base_s, backoff_max_s=backoff_max_s,
                                    retry_deadline_s=retry_deadline_s)
        self._prefetch_options = dict(max_inflight=max_inflight, group_records=group_records,
                                      coalesce_gap=coalesce_gap, max_request_bytes=max_request_bytes)
        self._locations, self._records, self._bytes = _shard_specs(source, self._source_options)
        self._shards = None
        self._shards_pid = None
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, records consumed by all ranks)
        self._consumed_here = 0
        self.last_stats: dict | None = None
        if not (self._records and all(self._records)):
            self._records = [0] * len(self._locations)
            self._num_records = len(self._open())
        else:
            self._num_records = sum(self._records)

    # Shards hold sockets and threads: never pickled, reopened in each process that iterates.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_shards"] = None
        state["_shards_pid"] = None
        return state

    def _open(self, workers: int = 1):
        if self._shards is None or self._shards_pid != os.getpid():
            cache_dir, cache_bytes = "", 0
            if self.disk_cache_dir is not None:
                cache_dir = os.path.join(self.disk_cache_dir, f"pid-{os.getpid()}")
                cache_bytes = max(self.disk_cache_bytes // workers, 1)
            self._shards = _C.StreamShards(self._locations, self._records, self._bytes,
                                           cache_dir, cache_bytes, **self._source_options)
            self._shards_pid = os.getpid()
        return self._shards

    @property
    def disk_cache_stats(self) -> dict:
        """used_bytes, budget, hit_bytes, miss_bytes of this process's disk cache ({} without one)."""
        return self._shards.disk_cache_stats if self._shards is not None else {}

    @property
    def num_records(self) -> int:
        """Records in the dataset (all shards)."""
        return self._num_records

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's order; a pending resume point applies only to its own epoch."""
        self.epoch = int(epoch)

    def _start(self) -> int:
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1]
        return 0

    def rank_order(self) -> np.ndarray:
        """The records this rank yields in the current epoch, in order (after any resume point)."""
        order = _C.stream_epoch_order(self._num_records, self.seed, self.epoch, self.shuffle,
                                      self.block_size)
        return _C.stream_rank_slice(order, self._start(), self.rank, self.world_size, self.drop_last)

    def __len__(self) -> int:
        return len(self.rank_order())

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        plan = _C.stream_worker_slice(self.rank_order(), worker, workers, self.batch_size)
        self._consumed_here = 0
        stream = self._open(workers).stream(plan, max(self.cache_bytes // workers, 4096),
                                     verify=self.verify_checksums, **self._prefetch_options)
        del plan  # the prefetcher holds its own copy
        try:
            for record in stream:
                self._consumed_here += 1
                yield record if self.transform is None else self.transform(record)
        finally:
            self.last_stats = stream.stats()
            del stream

    def state_dict(self, num_consumed: int | None = None) -> dict:
        """Where this epoch stands: enough to resume after the records already consumed.

        num_consumed: samples this rank's training loop has taken from the DataLoader this epoch
        (since the last resume). Default: the records yielded by in-process iteration, which is
        right without DataLoader workers (with workers, pass the count your loop saw)."""
        taken = self._consumed_here if num_consumed is None else int(num_consumed)
        if taken < 0:
            raise ValueError(f"num_consumed: expected >= 0, got {taken}")
        return {"version": STATE_VERSION, "epoch": self.epoch, "seed": self.seed,
                "shuffle": self.shuffle, "block_size": self.block_size,
                "num_records": self._num_records,
                "consumed": self._start() + taken * self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Resumes the state's epoch after the records it says were consumed; the number of ranks
        and of DataLoader workers may differ from the run that saved it."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"state['version']: expected {STATE_VERSION}, got {state.get('version')!r}")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle),
                          ("block_size", self.block_size), ("num_records", self._num_records)):
            if state.get(key) != mine:
                raise ValueError(f"state[{key!r}] is {state.get(key)!r} but this dataset has "
                                 f"{key} = {mine!r}; a resume needs the same dataset and order")
        consumed = int(state["consumed"])
        if consumed < 0:
            raise ValueError(f"state['consumed']: expected >= 0, got {consumed}")
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, consumed)
        self._consumed_here = 0
