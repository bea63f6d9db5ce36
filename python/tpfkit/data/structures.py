"""Structure files to records: mmCIF/PDB through gemmi, extxyz through ASE."""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from tpfkit.data.store import atoms_to_record

STRUCTURE_SUFFIXES = (".cif", ".mmcif", ".pdb", ".ent")
XYZ_SUFFIXES = (".xyz", ".extxyz")


def file_kind(path: str) -> str | None:
    """'structure' (mmCIF/PDB), 'extxyz' or None, by suffix (a trailing .gz is allowed)."""
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(STRUCTURE_SUFFIXES):
        return "structure"
    if name.endswith(XYZ_SUFFIXES):
        return "extxyz"
    return None


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".gz",) + STRUCTURE_SUFFIXES + XYZ_SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name


def _atoms_record(residues, identifier: str, resolution: float) -> dict[str, Any] | None:
    pos, z, names, res_index, res_names, chains, b, occ = [], [], [], [], [], [], [], []
    for chain_name, res in residues:
        for atom in res:
            p = atom.pos
            pos.append((p.x, p.y, p.z))
            z.append(atom.element.atomic_number)
            names.append(atom.name)
            res_index.append(res.seqid.num)
            res_names.append(res.name)
            chains.append(chain_name)
            b.append(atom.b_iso)
            occ.append(atom.occ)
    if not pos:
        return None
    return {
        "positions": np.asarray(pos, dtype=np.float64),
        "atomic_numbers": np.asarray(z, dtype=np.uint8),
        "atom_names": np.asarray([s.encode("ascii", "replace") for s in names], dtype=np.bytes_),
        "residue_index": np.asarray(res_index, dtype=np.int32),
        "residue_names": np.asarray([s.encode("ascii", "replace") for s in res_names], dtype=np.bytes_),
        "chain_id": np.asarray([s.encode("ascii", "replace") for s in chains], dtype=np.bytes_),
        "b_factors": np.asarray(b, dtype=np.float32),
        "occupancy": np.asarray(occ, dtype=np.float32),
        "identifier": identifier,
        "resolution": np.float64(resolution),
    }


def structure_records(path: str, per_chain: bool = False) -> Iterator[dict[str, Any]]:
    """Records of an mmCIF/PDB file (first model, first alternative conformation): one for the
    whole model, or with per_chain one per polymer chain (ligands and waters left out).
    Resolution is NaN when the file does not state it."""
    import gemmi

    try:
        st = gemmi.read_structure(path)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"cannot read structure {path}: {e}") from e
    if len(st) == 0:
        raise ValueError(f"structure {path} has no model")
    st.setup_entities()
    st.remove_alternative_conformations()
    name = st.info["_entry.id"] if "_entry.id" in st.info else (st.name or _stem(path))
    resolution = float(st.resolution) if st.resolution and st.resolution > 0 else math.nan
    model = st[0]
    if per_chain:
        for chain in model:
            polymer = chain.get_polymer()
            if len(polymer) == 0:
                continue
            rec = _atoms_record(((chain.name, r) for r in polymer), f"{name}_{chain.name}", resolution)
            if rec is not None:
                yield rec
        return
    rec = _atoms_record(((chain.name, r) for chain in model for r in chain), name, resolution)
    if rec is not None:
        yield rec


def extxyz_records(path: str) -> Iterator[dict[str, Any]]:
    """Records of an extended-XYZ file, one per frame; identifier from info or '<stem>:<frame>'."""
    from ase.io import iread

    stem = _stem(path)
    try:
        for i, atoms in enumerate(iread(path, index=":", format="extxyz")):
            rec = atoms_to_record(atoms)
            rec.setdefault("identifier", f"{stem}:{i}")
            rec["identifier"] = str(rec["identifier"])
            yield rec
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"cannot read extxyz {path}: {e}") from e


def file_records(path: str, per_chain: bool = False) -> Iterator[dict[str, Any]]:
    kind = file_kind(path)
    if kind == "structure":
        return structure_records(path, per_chain)
    if kind == "extxyz":
        return extxyz_records(path)
    raise ValueError(f"input {path} is not mmCIF/PDB (.cif .mmcif .pdb .ent) or extxyz (.xyz .extxyz)")
