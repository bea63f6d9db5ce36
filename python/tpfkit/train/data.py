"""Where the training chains come from, and which crops each step sees.

A record store (local shards, HTTP or S3) is streamed through FoldPipe's StreamingDataset, epoch
after epoch in its shuffled order; chains held in memory (a .npz, structure files) go in a seeded
permutation per epoch. Either way the batches follow from the position in that order, which the
checkpoint holds, so a resumed run sees exactly the batches of the uninterrupted one.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from tpfkit.train.features import ProteinChain, chains_from_atoms, crop_start, make_batch
from tpfkit.train.split import entry_bucket, held_out_bucket, manifest_buckets, record_entry


def chains_from_record(record: dict, min_residues: int = 16) -> list[ProteinChain]:
    """Protein chains of one record-store record (`tpf pack` of an mmCIF/PDB file, whole or per
    chain). A per-chain record's identifier is "<entry>_<chain>"; its chains are named the same."""
    identifier = str(record.get("identifier", "record"))
    missing = [k for k in ("chain_id", "residue_index", "residue_names", "atom_names", "positions")
               if k not in record]
    if missing:
        raise ValueError(f"record {identifier!r} has no {missing}: not a protein structure "
                         f"(pack mmCIF/PDB files with tpf pack)")

    def text(a):
        a = np.asarray(a)
        return np.char.decode(a, "ascii", "replace") if a.dtype.kind == "S" else a.astype(str)

    chain_ids = text(record["chain_id"])
    return chains_from_atoms(record_entry(record), chain_ids, record["residue_index"],
                             text(record["residue_names"]), text(record["atom_names"]),
                             np.asarray(record["positions"]), min_residues)


def iter_records(source: str) -> Iterator[dict]:
    """The records of a data source, in order:
    - an http(s):// or s3:// URL of a manifest or shard, streamed through FoldPipe;
    - a manifest.json, or a directory holding one, or one shard file (read through mmap);
    - a directory of mmCIF/PDB files (.gz or not), read as `tpf pack` would pack them.
    """
    from tpfkit.data import RecordReader, StreamingDataset, read_manifest
    from tpfkit.data.streaming import is_remote

    if is_remote(source):
        yield from StreamingDataset(source, shuffle=False, world_size=1, rank=0)
        return
    path = Path(source.removeprefix("file://"))
    if not path.exists():
        raise FileNotFoundError(f"data source {source!r} does not exist")
    if path.is_dir() and (path / "manifest.json").is_file():
        path = path / "manifest.json"
    if path.is_file() and path.suffix == ".json":
        for shard in read_manifest(str(path))["shards"]:
            yield from RecordReader(shard["location"])
    elif path.is_file():
        yield from RecordReader(path)
    else:
        from tpfkit.data.structures import file_kind, file_records

        files = sorted(p for p in path.rglob("*") if file_kind(p.name) == "structure")
        if not files:
            raise ValueError(f"data source {source!r} holds neither manifest.json nor mmCIF/PDB files")
        for f in files:
            yield from file_records(str(f))


def save_chains(chains: Sequence[ProteinChain], path: str) -> None:
    """The chains' training features in one .npz (for machines whose build has no record store:
    `python -m tpfkit.train.data SOURCE OUT.npz`)."""
    arrays = {}
    for i, c in enumerate(chains):
        arrays.update({f"{i}/name": np.array(c.name), f"{i}/aatype": c.aatype,
                       f"{i}/residue_index": c.residue_index, f"{i}/positions": c.positions,
                       f"{i}/position_mask": c.position_mask})
    np.savez_compressed(path, count=np.array(len(chains)), **arrays)


def _load_chains_npz(path: Path) -> list[ProteinChain]:
    with np.load(path) as f:
        return [ProteinChain(str(f[f"{i}/name"]), f[f"{i}/aatype"], f[f"{i}/residue_index"],
                             f[f"{i}/positions"], f[f"{i}/position_mask"])
                for i in range(int(f["count"]))]


def load_chains(source: str, min_residues: int = 16, progress: bool = True) -> list[ProteinChain]:
    """All protein chains of a data source (see iter_records, or a .npz from save_chains), held in
    memory: pseudo-beta positions and types only, about 30 bytes a residue."""
    if source.endswith(".npz"):
        chains = [c for c in _load_chains_npz(Path(source)) if len(c) >= min_residues]
        if not chains:
            raise ValueError(f"data source {source!r} has no protein chain of >= {min_residues} residues")
        return chains
    chains = []
    for record in tqdm(iter_records(source), desc="reading records", unit="record",
                       disable=not progress, leave=False):
        chains.extend(chains_from_record(record, min_residues))
    if not chains:
        raise ValueError(f"data source {source!r} has no protein chain of >= {min_residues} residues")
    return chains


def is_held_out(chain: ProteinChain, val_fraction: float) -> bool:
    """Whether a chain's entry is held out for validation: a hash of the entry name, so the split
    depends neither on the order nor on the number of files, and an entry's chains stay together."""
    return bool(held_out_bucket(entry_bucket(chain.name.rsplit("_", 1)[0]), val_fraction))


def held_out_chains(dataset, location: str, val_fraction: float, max_records: int,
                    min_residues: int = 16, progress: bool = True) -> list[ProteinChain]:
    """The held-out chains of a record store: those of its first `max_records` held-out records
    in store order. `dataset` is the training stream's StreamingDataset over `location`. When its
    manifest carries the records' entry hashes (`tpf pack` writes them), only those records are
    read; otherwise the records are read in order until that many held-out ones have come."""
    if val_fraction <= 0:
        return []
    manifests = dataset.manifests
    buckets = manifest_buckets(json.loads(manifests[0]["text"])) if len(manifests) == 1 else None
    if buckets is not None and len(buckets) == dataset.num_records:
        indices = np.flatnonzero(held_out_bucket(buckets, val_fraction))[:max_records]
        records = tqdm(dataset.records_at(indices), total=len(indices), unit="record",
                       desc="reading held-out records", disable=not progress, leave=False)
    else:
        warnings.warn(f"{location}: no manifest with the records' entry hashes (packed before "
                      f"tpf pack wrote them, or a shard file): finding the held-out records reads "
                      f"the store in order; pack it again to read only them", stacklevel=2)

        def scan():
            found = 0
            for record in tqdm(iter_records(location), desc="finding held-out records",
                               unit="record", disable=not progress, leave=False):
                if held_out_bucket(entry_bucket(record_entry(record)), val_fraction):
                    found += 1
                    yield record
                    if found == max_records:
                        return
        records = scan()
    return [c for record in records for c in chains_from_record(record, min_residues)
            if is_held_out(c, val_fraction)]


class TrainSide:
    """Keeps the chains that are not held out (picklable, for DataLoader workers)."""

    def __init__(self, val_fraction: float):
        self.val_fraction = val_fraction

    def __call__(self, chain: ProteinChain) -> bool:
        return not is_held_out(chain, self.val_fraction)


def split_by_entry(chains: Sequence[ProteinChain], val_fraction: float):
    """(train, validation) by is_held_out."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    train, val = [], []
    for c in chains:
        (val if is_held_out(c, val_fraction) else train).append(c)
    if not train:
        raise ValueError(f"val_fraction {val_fraction} leaves no training chain")
    return train, val


def record_store_location(source: str) -> str | None:
    """The location to stream when `source` is a record store (a URL, a manifest, a directory
    holding manifest.json, or one shard file), else None (a directory of structure files, .npz)."""
    from tpfkit import _C

    # A build without the record store (the GPU machine's) trains from chains in memory only.
    if source.endswith(".npz") or not _C.with_data:
        return None
    if _C.stream_is_remote(source):
        return source
    path = Path(source.removeprefix("file://"))
    if path.is_dir() and (path / "manifest.json").is_file():
        return str(path / "manifest.json")
    if path.is_file() and path.suffix in (".json", ".tpf"):
        return str(path)
    return None


class StreamedChains:
    """Protein chains in the order FoldPipe streams their records: StreamingDataset's shuffle for
    (seed, epoch), this rank's share, its byte budget, epoch after epoch. A record gives its chains
    in order (none when all are short or held out). The state is the loader's plus how many chains
    of a record already went out, so a resumed run sees exactly the chains the uninterrupted one
    would have; `loader_workers` DataLoader processes turn records into chains meanwhile."""

    def __init__(self, location: str, seed: int, cache_bytes: int, keep=None,
                 loader_workers: int = 0, min_residues: int = 16):
        from tpfkit.data import StreamingDataset

        self.dataset = StreamingDataset(location, cache_bytes=cache_bytes, shuffle=True, seed=seed,
                                        transform=_RecordChains(min_residues, keep))
        self.workers = loader_workers
        self.records = 0  # records taken this epoch (after the resume point)
        self.pending: list[ProteinChain] = []  # chains of the last record not handed out yet
        self.used = 0  # chains of that record handed out
        self.skip = 0  # chains of the first record to drop (a resume inside a record)
        self._it = None
        self.read_s = 0.0  # time spent waiting for records
        self.records_read = 0

    def _next_record(self) -> tuple[int, list[ProteinChain]]:
        import torch

        while True:
            if self._it is None:
                loader = torch.utils.data.DataLoader(self.dataset, batch_size=None,
                                                     num_workers=self.workers,
                                                     collate_fn=_as_is)
                self._it = iter(loader)
            try:
                t0 = time.perf_counter()
                chains = next(self._it)
                self.read_s += time.perf_counter() - t0
                self.records_read += 1
                self.records += 1
                return self.records, chains
            except StopIteration:
                self._it = None
                self.dataset.set_epoch(self.dataset.epoch + 1)
                self.records = 0
                if len(self.dataset) == 0:
                    raise ValueError("the data source has no record for this rank") from None

    def next(self) -> tuple[tuple[int, ...], ProteinChain]:
        """The next chain and its key (epoch, record position, chain) for its crop's randomness."""
        while not self.pending:
            position, chains = self._next_record()
            self.used, self.skip = self.skip, 0
            self.pending = chains[self.used:]
        self.used += 1
        ds = self.dataset
        key = (ds.epoch, ds.state_dict(num_consumed=self.records)["consumed"] // ds.world_size,
               self.used)
        return key, self.pending.pop(0)

    def state_dict(self) -> dict:
        # A record with chains still pending is taken again on resume, its first `used` dropped.
        partial = bool(self.pending)
        taken = self.records - 1 if partial else self.records
        return {"loader": self.dataset.state_dict(num_consumed=taken),
                "used": self.used if partial else 0}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["loader"])
        self._it, self.pending, self.records = None, [], 0
        self.skip = int(state["used"])

    def throughput(self) -> dict:
        stats = self.dataset.last_stats or {}
        return {"records": self.records_read, "wait_s": self.read_s,
                "records_per_s": self.records_read / self.read_s if self.read_s else None,
                "retries": stats.get("retries", 0), "refetches": stats.get("refetches", 0)}


def _as_is(item):
    return item


class _RecordChains:
    """A record's chains (picklable, for DataLoader workers), less those `keep` rejects."""

    def __init__(self, min_residues: int, keep):
        self.min_residues, self.keep = min_residues, keep

    def __call__(self, record: dict) -> list[ProteinChain]:
        chains = chains_from_record(record, self.min_residues)
        return [c for c in chains if self.keep is None or self.keep(c)]


class MemoryChains:
    """Chains held in memory (a .npz or structure files, for builds without the record store),
    one seeded permutation per epoch; the state is (epoch, position)."""

    def __init__(self, chains: Sequence[ProteinChain], seed: int):
        if not chains:
            raise ValueError("no training chain")
        self.chains, self.seed = list(chains), seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.chains))

    def next(self) -> tuple[tuple[int, ...], ProteinChain]:
        if self.position == len(self.chains):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        key = (self.epoch, self.position)
        self.position += 1
        return key, self.chains[self._order[self.position - 1]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()

    def throughput(self) -> dict:
        return {}


class CropBatches:
    """Batches of `batch_size` chains in the order `chains` (StreamedChains or MemoryChains) gives
    them, each cropped at a random start drawn from (seed, the chain's key): what a batch holds
    depends only on the position in that order, so the chains' state resumes the batches too."""

    def __init__(self, chains, batch_size: int, crop_size: int, seed: int):
        if batch_size < 1 or crop_size < 1:
            raise ValueError(f"batch_size and crop_size must be >= 1, got {batch_size} and {crop_size}")
        self.chains, self.batch_size, self.crop_size, self.seed = chains, batch_size, crop_size, seed

    def next(self) -> dict:
        picks, starts = [], []
        for _ in range(self.batch_size):
            key, chain = self.chains.next()
            rng = np.random.default_rng([self.seed, *key])
            picks.append(chain)
            starts.append(crop_start(len(chain), self.crop_size, rng))
        return make_batch(picks, starts, self.crop_size)


def fixed_batches(chains: Sequence[ProteinChain], batch_size: int, crop_size: int) -> list[dict]:
    """Every chain once, cropped at its middle: a validation set that never changes."""
    starts = [max(0, (len(c) - crop_size) // 2) for c in chains]
    return [make_batch(chains[i:i + batch_size], starts[i:i + batch_size], crop_size)
            for i in range(0, len(chains), batch_size)]



if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m tpfkit.train.data SOURCE OUT.npz")
    save_chains(load_chains(sys.argv[1]), sys.argv[2])
