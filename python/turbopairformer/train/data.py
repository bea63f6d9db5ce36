"""Where the training chains come from, and which crops each step sees.

The batch of step t is a pure function of (seed, t): resuming at step t sees exactly the data the
uninterrupted run would have seen, with no loader state to save.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from turbopairformer.train.features import ProteinChain, chains_from_atoms, crop_start, make_batch

STRUCTURE_SUFFIXES = (".pdb", ".ent", ".cif", ".mmcif")


def _is_structure_file(path: Path) -> bool:
    name = path.name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return name.endswith(STRUCTURE_SUFFIXES)


def chains_from_structure_file(path: Path, min_residues: int = 16) -> list[ProteinChain]:
    """Protein chains of the first model of a PDB or mmCIF file (gzipped or not), read by gemmi."""
    import gemmi

    st = gemmi.read_structure(str(path))
    st.remove_alternative_conformations()
    st.remove_hydrogens()
    chain_ids, numbers, res_names, atom_names, positions = [], [], [], [], []
    for chain in st[0]:
        for residue in chain:
            for atom in residue:
                chain_ids.append(chain.name)
                numbers.append(residue.seqid.num)
                res_names.append(residue.name)
                atom_names.append(atom.name)
                positions.append((atom.pos.x, atom.pos.y, atom.pos.z))
    name = path.name.split(".")[0]
    return chains_from_atoms(name, chain_ids, numbers, res_names, atom_names,
                             np.asarray(positions, dtype=np.float32).reshape(-1, 3), min_residues)


def load_chains(source: str, min_residues: int = 16, progress: bool = True) -> list[ProteinChain]:
    """All protein chains of a data source: a directory of structure files (PDB/mmCIF, .gz or not)."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data source {source!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"data source must be a directory of structure files, got {source!r}")
    files = sorted(p for p in path.iterdir() if _is_structure_file(p))
    if not files:
        raise ValueError(f"data source {source!r} holds no .pdb/.ent/.cif files (gzipped or not)")
    chains = []
    for f in tqdm(files, desc="reading structures", unit="file", disable=not progress,
                  leave=False):
        chains.extend(chains_from_structure_file(f, min_residues))
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

