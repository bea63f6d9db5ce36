"""Protein chains as the distogram task sees them: residue types, pseudo-beta positions, crops, batches.

A chain comes from per-atom arrays (chain id, residue number, residue name, atom name, position), the
form both a structure file and a record-store record give, so there is one conversion for both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

# The 20 standard amino acids in AlphaFold's order; index 20 is "unknown" (also the padding type).
RESIDUE_NAMES = ("ALA", "ARG", "ASN", "ASP", "CYS", "GLN", "GLU", "GLY", "HIS", "ILE",
                 "LEU", "LYS", "MET", "PHE", "PRO", "SER", "THR", "TRP", "TYR", "VAL")
UNKNOWN_TYPE = len(RESIDUE_NAMES)
NUM_TYPES = UNKNOWN_TYPE + 1
# Modified residues common in crystal structures, read as their parent amino acid.
_PARENTS = {"MSE": "MET", "SEP": "SER", "TPO": "THR", "PTR": "TYR", "HYP": "PRO", "MLY": "LYS",
            "CSO": "CYS", "KCX": "LYS", "LLP": "LYS", "SEC": "CYS", "PYL": "LYS"}
_TYPE_OF = {name: i for i, name in enumerate(RESIDUE_NAMES)}
_TYPE_OF.update({m: _TYPE_OF[p] for m, p in _PARENTS.items()})
_GLY = _TYPE_OF["GLY"]


@dataclass(frozen=True)
class ProteinChain:
    """One protein chain: L residues with a type, a number and a pseudo-beta position."""
    name: str
    aatype: np.ndarray         # int64 [L], 0..20
    residue_index: np.ndarray  # int64 [L], the residue numbers of the file (gaps show as jumps)
    positions: np.ndarray      # float32 [L, 3], C-beta (C-alpha for glycine), angstrom
    position_mask: np.ndarray  # bool [L], False where that atom is missing

    def __len__(self) -> int:
        return len(self.aatype)


def chains_from_atoms(name: str, chain_ids: Sequence[str], residue_numbers: Sequence[int],
                      residue_names: Sequence[str], atom_names: Sequence[str],
                      positions: np.ndarray, min_residues: int = 16) -> list[ProteinChain]:
    """Protein chains of at least min_residues amino acids from per-atom arrays in file order.

    A residue is a run of atoms with the same (chain id, residue number, residue name); residues
    that are not amino acids (water, ligands, nucleotides) are dropped.
    """
    n = len(atom_names)
    for arg, values in (("chain_ids", chain_ids), ("residue_numbers", residue_numbers),
                        ("residue_names", residue_names), ("positions", positions)):
        if len(values) != n:
            raise ValueError(f"{arg} must have one entry per atom ({n}), got {len(values)}")
    residues: dict[str, list] = {}
    key = None
    for i in range(n):
        res_name = str(residue_names[i]).strip().upper()
        if res_name not in _TYPE_OF:
            key = None
            continue
        this = (chain_ids[i], int(residue_numbers[i]), res_name)
        if this != key:
            key = this
            residues.setdefault(str(chain_ids[i]), []).append(
                [_TYPE_OF[res_name], int(residue_numbers[i]), None, None])
        residue = residues[str(chain_ids[i])][-1]
        atom = str(atom_names[i]).strip().upper()
        if atom == "CB":
            residue[2] = positions[i]
        elif atom == "CA":
            residue[3] = positions[i]
    chains = []
    for chain_id, res in residues.items():
        if len(res) < min_residues:
            continue
        aatype = np.array([r[0] for r in res], dtype=np.int64)
        pseudo_beta = [r[3] if t == _GLY else r[2] for t, r in zip(aatype, res)]
        mask = np.array([p is not None for p in pseudo_beta])
        pos = np.zeros((len(res), 3), dtype=np.float32)
        if mask.any():
            pos[mask] = np.stack([p for p in pseudo_beta if p is not None])
        chains.append(ProteinChain(f"{name}_{chain_id or '-'}", aatype,
                                   np.array([r[1] for r in res], dtype=np.int64), pos, mask))
    return chains


def crop_start(length: int, crop_size: int, rng: np.random.Generator) -> int:
    """A uniformly random start of a contiguous crop (0 when the chain fits)."""
    return int(rng.integers(0, length - crop_size + 1)) if length > crop_size else 0


def make_batch(chains: Iterable[ProteinChain], starts: Iterable[int], crop_size: int) -> dict:
    """Crops [start, start + crop_size) of each chain, padded to crop_size, as a batch of tensors.

    aatype [B, N] (padding: unknown type), residue_index [B, N], positions [B, N, 3],
    position_mask [B, N], token_mask [B, N] (False on padding).
    """
    chains, starts = list(chains), list(starts)
    B, N = len(chains), crop_size
    aatype = np.full((B, N), UNKNOWN_TYPE, dtype=np.int64)
    residue_index = np.zeros((B, N), dtype=np.int64)
    positions = np.zeros((B, N, 3), dtype=np.float32)
    position_mask = np.zeros((B, N), dtype=bool)
    token_mask = np.zeros((B, N), dtype=bool)
    for b, (chain, start) in enumerate(zip(chains, starts)):
        if not 0 <= start < max(len(chain), 1):
            raise ValueError(f"crop start {start} is outside chain {chain.name} of {len(chain)} residues")
        sl = slice(start, start + N)
        L = len(chain.aatype[sl])
        aatype[b, :L] = chain.aatype[sl]
        residue_index[b, :L] = chain.residue_index[sl]
        positions[b, :L] = chain.positions[sl]
        position_mask[b, :L] = chain.position_mask[sl]
        token_mask[b, :L] = True
    return {k: torch.from_numpy(v) for k, v in (
        ("aatype", aatype), ("residue_index", residue_index), ("positions", positions),
        ("position_mask", position_mask), ("token_mask", token_mask))}


def distogram_targets(positions: torch.Tensor, position_mask: torch.Tensor,
                      boundaries: torch.Tensor):
    """Distance bins between pseudo-beta atoms: (targets [B, N, N] long, pair_mask [B, N, N]).

    Bin k holds distances in [boundaries[k-1], boundaries[k]); bin 0 everything below the first
    boundary and the last bin everything from the last boundary on.
    """
    dist = torch.cdist(positions.double(), positions.double())
    targets = torch.bucketize(dist, boundaries.double(), right=True)
    pair_mask = position_mask[:, :, None] & position_mask[:, None, :]
    return targets, pair_mask
