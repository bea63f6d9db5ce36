"""FoldPipe: record-store shards streamed from local files, HTTP(S) or S3 under a hard memory budget.

`StreamingDataset` is a torch IterableDataset. Each epoch has one deterministic order for
(seed, epoch); ranks take interleaved entries of it and DataLoader workers take batches of their
rank's list round-robin, which is the order DataLoader hands batches back in. So what one rank has
consumed is always a prefix of its list, and `state_dict(num_consumed)` resumes exactly after it,
with any number of workers. The memory budget (`cache_bytes`) is shared by the workers: each
worker's prefetcher gets `cache_bytes // num_workers`.

The dataset is opened in one call into C++ (manifests read, checked and resolved there), and each
epoch's stream is one more (the worker's plan is made there from the sampler's arguments).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from tpfkit import _C

STATE_VERSION = 1

is_remote = _C.stream_is_remote


def stream_defaults() -> dict:
    """The loader's options (sources and prefetcher; include/tpf/stream.h) and their defaults."""
    return _C.stream_defaults()


def read_manifest(location: str, **options: Any) -> dict:
    """The manifest `tpf pack` writes, read from a path or URL and checked (JSON, format, version,
    manifest_sha256; a remote one is downloaded again when a check fails), with every shard's
    `location` resolved (its `url` when present, else its `path` relative to the manifest)."""
    read = _C.stream_read_manifest(location, **options)
    manifest = json.loads(read["text"])
    for shard, resolved in zip(manifest["shards"], read["shard_locations"]):
        shard["location"] = resolved
    return manifest


def _locations(source: str | Sequence[str]) -> list[str]:
    if isinstance(source, str):
        return [source]
    if isinstance(source, Sequence) and source and all(isinstance(s, str) for s in source):
        return list(source)
    raise ValueError(f"source: expected a manifest (.json path or URL), a shard location or a "
                     f"list of them, got {source!r}")


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class StreamingDataset(torch.utils.data.IterableDataset):
    """Records of record-store shards, streamed in a deterministic shuffled order.

    source: a manifest (path or URL of the JSON `tpf pack` writes), one shard location or a list
        of them; locations are paths, file://, http(s):// or s3:// URLs.
    cache_bytes: hard limit on prefetched bytes held in memory, over all DataLoader workers
        (default: the prefetcher's memory_budget).
    shuffle, seed: one permutation per (seed, epoch); block_size > 0 shuffles blocks of that many
        neighbouring records (and inside each block) for locality of range reads.
    rank, world_size: this process's share (default: torch.distributed, else RANK / WORLD_SIZE).
    drop_last: every rank gets the same count by dropping the tail (True) or repeating records (False).
    batch_size: the DataLoader's batch size, so that workers split the rank's list by whole batches.
    transform: applied to each record (a dict of numpy arrays) before it is yielded.
    disk_cache_dir, disk_cache_bytes: keep fetched bytes of remote shards on local disk (a folder
        per process under disk_cache_dir, the budget shared by the DataLoader workers), so later
        epochs read them locally.
    **options: the sources' and the prefetcher's options by their C++ names (max_connections,
        http_threads, timeouts, max_attempts, backoffs, full_body_max_bytes, max_inflight,
        coalesce_gap, max_request_bytes, group_records, verify_attempts, ...;
        `stream_defaults()` lists them with their defaults, include/tpf/stream.h says what each does).

    `last_stats` holds the last epoch's counters: requests, bytes, refetches of corrupt records,
    retries, 200 answers read as whole bodies, refused multi-range requests.
    """

    def __init__(self, source: str | Sequence[str], cache_bytes: int | None = None,
                 shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, *, block_size: int = 0, drop_last: bool = False,
                 batch_size: int = 1, transform: Callable[[dict], Any] | None = None,
                 verify_checksums: bool = True, disk_cache_dir: str | None = None,
                 disk_cache_bytes: int = 0, **options: Any):
        super().__init__()
        if "memory_budget" in options:
            raise ValueError("memory_budget: give cache_bytes, the budget over all workers")
        if cache_bytes is None:
            cache_bytes = stream_defaults()["memory_budget"]
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
        self._locations = _locations(source)
        self._options = dict(options)
        self._dataset = None
        self._dataset_pid = None
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, records consumed by all ranks)
        self._consumed_here = 0
        self.last_stats: dict | None = None
        self._num_records = len(self._open())

    # The opened dataset holds sockets and threads: never pickled, reopened in each process that
    # iterates.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_dataset"] = None
        state["_dataset_pid"] = None
        return state

    def _open(self, workers: int = 1):
        if self._dataset is None or self._dataset_pid != os.getpid():
            cache_dir, cache_bytes = "", 0
            if self.disk_cache_dir is not None:
                cache_dir = os.path.join(self.disk_cache_dir, f"pid-{os.getpid()}")
                cache_bytes = max(self.disk_cache_bytes // workers, 1)
            self._dataset = _C.StreamDataset(self._locations, cache_dir, cache_bytes, **self._options)
            self._dataset_pid = os.getpid()
        return self._dataset

    @property
    def disk_cache_stats(self) -> dict:
        """used_bytes, budget, hit_bytes, miss_bytes of this process's disk cache ({} without one)."""
        return self._dataset.disk_cache_stats if self._dataset is not None else {}

    @property
    def source_stats(self) -> dict:
        """This process's sources' counters since the dataset was opened (opening included):
        retries, full_body_answers, multi_range_refused, single_range_spells, multi_range_probes."""
        return self._open().source_stats

    @property
    def manifests(self) -> list[dict]:
        """The manifests the dataset was opened from: location, text, verified, downloads."""
        return self._open().manifests

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

    def _plan(self, worker: int = 0, workers: int = 1) -> dict:
        return dict(seed=self.seed, epoch=self.epoch, shuffle=self.shuffle,
                    block_size=self.block_size, rank=self.rank, world_size=self.world_size,
                    worker=worker, num_workers=workers, batch_size=self.batch_size,
                    consumed=self._start(), drop_last=self.drop_last)

    def rank_order(self) -> np.ndarray:
        """The records this rank yields in the current epoch, in order (after any resume point)."""
        return _C.stream_plan(self._num_records, self._plan())

    def __len__(self) -> int:
        return self._open().rank_count(self._plan())

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        self._consumed_here = 0
        stream = self._open(workers).stream(self._plan(worker, workers),
                                            max(self.cache_bytes // workers, 4096),
                                            self.verify_checksums)
        try:
            for record in stream:
                self._consumed_here += 1
                yield record if self.transform is None else self.transform(record)
        finally:
            self.last_stats = stream.stats()
            del stream

    def records_at(self, indices: Sequence[int], lookahead: int = 4) -> Iterator[Any]:
        """The records at these dataset positions (0 .. num_records - 1), in that order, as
        stored (without the transform): only they are read, each through a stream of its own (a
        plan whose one entry is that record), `lookahead` of them fetching at once. For a few
        scattered records (a validation set); the epoch's state is not touched."""
        import collections

        n = self._num_records
        dataset = self._open()

        def start(i: int):
            i = int(i)
            if not 0 <= i < n:
                raise IndexError(f"record {i} is out of range (the dataset has {n})")
            plan = dict(shuffle=False, rank=i, world_size=n, drop_last=True)
            # The whole budget, so any record the epoch's stream can hold fits; what is resident
            # is the `lookahead` records themselves.
            return dataset.stream(plan, self.cache_bytes, self.verify_checksums)

        todo, pending = iter(indices), collections.deque()
        while True:
            while len(pending) < max(lookahead, 1):
                i = next(todo, None)
                if i is None:
                    break
                pending.append(start(i))
            if not pending:
                return
            stream = pending.popleft()
            record = next(stream)
            del stream
            yield record

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
