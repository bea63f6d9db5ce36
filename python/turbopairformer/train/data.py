"""Where the training chains come from, and which crops each step sees.

The batch of step t is a pure function of (seed, t): resuming at step t sees exactly the data the
uninterrupted run would have seen, with no loader state to save.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from turbopairformer.train.features import ProteinChain, chains_from_atoms, crop_start, make_batch


def _is_url(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


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
    entry = identifier
    if len(chain_ids) and (chain_ids == chain_ids[0]).all() and identifier.endswith("_" + chain_ids[0]):
        entry = identifier[:-len(chain_ids[0]) - 1]
    return chains_from_atoms(entry, chain_ids, record["residue_index"], text(record["residue_names"]),
                             text(record["atom_names"]), np.asarray(record["positions"]), min_residues)


def iter_records(source: str) -> Iterator[dict]:
    """The records of a data source, in order:
    - an http(s):// or s3:// URL of a manifest or shard, streamed through FoldPipe;
    - a manifest.json, or a directory holding one, or one shard file (read through mmap);
    - a directory of mmCIF/PDB files (.gz or not), read as `tpf pack` would pack them.
    """
    from turbopairformer.data import RecordReader, StreamingDataset, read_manifest

    if _is_url(source):
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
        from turbopairformer.data.structures import file_kind, file_records

        files = sorted(p for p in path.rglob("*") if file_kind(p.name) == "structure")
        if not files:
            raise ValueError(f"data source {source!r} holds neither manifest.json nor mmCIF/PDB files")
        for f in files:
            yield from file_records(str(f))


def save_chains(chains: Sequence[ProteinChain], path: str) -> None:
    """The chains' training features in one .npz (for machines whose build has no record store:
    `python -m turbopairformer.train.data SOURCE OUT.npz`)."""
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


def split_by_entry(chains: Sequence[ProteinChain], val_fraction: float):
    """(train, validation): whole entries go to one side, chosen by a hash of the entry name, so
    the split does not depend on the order or the number of files."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    train, val = [], []
    for c in chains:
        entry = c.name.rsplit("_", 1)[0]
        (val if zlib.crc32(entry.encode()) % 10_000 < val_fraction * 10_000 else train).append(c)
    if not train:
        raise ValueError(f"val_fraction {val_fraction} leaves no training chain")
    return train, val


class CropSampler:
    """Random chains and random contiguous crops; the batch of step t depends only on (seed, t)."""

    def __init__(self, chains: Sequence[ProteinChain], batch_size: int, crop_size: int, seed: int):
        if batch_size < 1 or crop_size < 1:
            raise ValueError(f"batch_size and crop_size must be >= 1, got {batch_size} and {crop_size}")
        self.chains = list(chains)
        self.batch_size = batch_size
        self.crop_size = crop_size
        self.seed = seed

    def batch(self, step: int) -> dict:
        rng = np.random.default_rng([self.seed, step])
        picks = rng.choice(len(self.chains), self.batch_size,
                           replace=self.batch_size > len(self.chains))
        chains = [self.chains[i] for i in picks]
        starts = [crop_start(len(c), self.crop_size, rng) for c in chains]
        return make_batch(chains, starts, self.crop_size)


def fixed_batches(chains: Sequence[ProteinChain], batch_size: int, crop_size: int) -> list[dict]:
    """Every chain once, cropped at its middle: a validation set that never changes."""
    starts = [max(0, (len(c) - crop_size) // 2) for c in chains]
    return [make_batch(chains[i:i + batch_size], starts[i:i + batch_size], crop_size)
            for i in range(0, len(chains), batch_size)]



if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m turbopairformer.train.data SOURCE OUT.npz")
    save_chains(load_chains(sys.argv[1]), sys.argv[2])
