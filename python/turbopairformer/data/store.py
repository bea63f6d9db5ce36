"""The record store's Python API: dicts of numpy arrays in, dicts of numpy arrays out.

A record is one complete structure: a dict from key to a numpy array (or a Python scalar / str).
Well-known keys are checked for shape and dtype (see `BUILTIN`); any other key holds any typed
N-d array. FORMAT.md describes the bytes.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from turbopairformer import _C

# Per-atom keys: the first axis is the atom axis (its length must match `positions`).
PER_ATOM = ("positions", "atomic_numbers", "forces", "charges", "velocities", "b_factors",
            "occupancy", "residue_index", "residue_names", "chain_id", "atom_names")
# Fixed shapes of per-record arrays.
FIXED_SHAPES = {"cell": [(3, 3)], "pbc": [(3,)], "stress": [(6,), (3, 3)]}
SCALARS = ("energy", "resolution")
# Per-atom trailing shapes where they are fixed.
ATOM_TRAILING = {"positions": (3,), "forces": (3,), "velocities": (3,)}


def _check_record(rec: dict[str, Any], positions_dtype: np.dtype, batch: int | None) -> dict[str, Any]:
    """Checks well-known keys and applies the positions dtype. With `batch`, arrays carry a leading
    record axis of that length. Returns a new dict; raises ValueError naming the key."""
    out: dict[str, Any] = {}
    lead = 0 if batch is None else 1
    n_atoms = None
    for key, value in rec.items():
        if not isinstance(key, str):
            raise ValueError(f"record keys must be str, got {key!r}")
        if key == "identifier":
            if batch is None:
                if not isinstance(value, (str, np.str_)):
                    raise ValueError(f"record field 'identifier' must be a str, got {type(value).__name__}")
                out[key] = str(value)
                continue
            value = np.asarray(value)
            if value.dtype.kind != "U" or value.shape != (batch,):
                raise ValueError(f"batch column 'identifier' must be {batch} str, got {value.dtype} {value.shape}")
            out[key] = value
            continue
        arr = np.asarray(value)
        if arr.dtype == object:
            raise ValueError(f"record field '{key}' has no numeric or text dtype (got object)")
        if key == "positions":
            if arr.dtype.kind != "f":
                raise ValueError(f"record field 'positions' must be floating point, got {arr.dtype}")
            arr = arr.astype(positions_dtype, copy=False)
        if key == "atomic_numbers" and arr.dtype.kind not in "iu":
            raise ValueError(f"record field 'atomic_numbers' must be integers, got {arr.dtype}")
        if key == "pbc":
            arr = arr.astype(bool, copy=False)
        shape = arr.shape[lead:]
        if batch is not None and (arr.ndim == 0 or arr.shape[0] != batch):
            raise ValueError(f"batch column '{key}' must have a leading axis of {batch} records, got shape {arr.shape}")
        if key in PER_ATOM:
            if len(shape) < 1:
                raise ValueError(f"record field '{key}' is per-atom and needs an atom axis, got shape {shape}")
            if key in ATOM_TRAILING and shape[1:] != ATOM_TRAILING[key]:
                raise ValueError(f"record field '{key}' must have shape [n_atoms, 3], got {list(shape)}")
            if n_atoms is None:
                n_atoms = (key, shape[0])
            elif shape[0] != n_atoms[1]:
                raise ValueError(f"record field '{key}' has {shape[0]} atoms but '{n_atoms[0]}' has {n_atoms[1]}")
        elif key in FIXED_SHAPES and shape not in FIXED_SHAPES[key]:
            want = " or ".join(str(list(s)) for s in FIXED_SHAPES[key])
            raise ValueError(f"record field '{key}' must have shape {want}, got {list(shape)}")
        elif key in SCALARS and shape != ():
            raise ValueError(f"record field '{key}' must be a scalar, got shape {list(shape)}")
        out[key] = arr
    return out


def atoms_to_record(atoms) -> dict[str, Any]:
    """An ASE `Atoms` as a record: numbers, positions, cell and pbc (when periodic or a cell is
    set), the calculator's stored results (energy, forces, stress, ...), extra per-atom arrays and
    numeric or text `info` entries. Nothing is computed."""
    rec: dict[str, Any] = {
        "atomic_numbers": np.asarray(atoms.numbers, dtype=np.uint8),
        "positions": np.asarray(atoms.positions),
    }
    if atoms.cell.rank > 0 or atoms.pbc.any():
        rec["cell"] = np.asarray(atoms.cell[:], dtype=np.float64)
        rec["pbc"] = np.asarray(atoms.pbc, dtype=bool)
    for name, arr in atoms.arrays.items():
        if name not in ("numbers", "positions") and not name.startswith("_"):
            rec[name] = np.asarray(arr)
    if atoms.calc is not None:
        for name, value in atoms.calc.results.items():
            if not name.startswith("_"):
                rec[name] = np.asarray(value) if not np.isscalar(value) else value
    for name, value in atoms.info.items():
        if name.startswith("_") or name in rec:
            continue
        if isinstance(value, (str, int, float, bool, np.number, np.bool_)) or (
                isinstance(value, np.ndarray) and value.dtype != object):
            rec[name] = value
    return rec


def record_to_atoms(rec: Mapping[str, Any]):
    """A record as an ASE `Atoms`; energy, forces and stress go to a SinglePointCalculator, other
    per-atom arrays to `atoms.arrays`, everything else to `atoms.info`."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    if "atomic_numbers" not in rec or "positions" not in rec:
        raise ValueError("record needs 'atomic_numbers' and 'positions' to become an ase.Atoms")
    numbers = np.asarray(rec["atomic_numbers"])
    n = len(numbers)
    atoms = Atoms(numbers=numbers.astype(int), positions=np.asarray(rec["positions"], dtype=np.float64),
                  cell=rec.get("cell"), pbc=rec.get("pbc", False))
    results = {k: rec[k] for k in ("energy", "forces", "stress") if k in rec}
    for key, value in rec.items():
        if key in ("atomic_numbers", "positions", "cell", "pbc") or key in results:
            continue
        if isinstance(value, np.ndarray) and value.ndim >= 1 and len(value) == n and key != "identifier":
            atoms.set_array(key, np.array(value))
        else:
            atoms.info[key] = value.item() if isinstance(value, np.generic) else value
    if results:
        atoms.calc = SinglePointCalculator(atoms, **{k: np.array(v) if isinstance(v, np.ndarray) else float(v)
                                                      for k, v in results.items()})
    return atoms


def _as_record(record) -> Mapping[str, Any]:
    if isinstance(record, Mapping):
        return record
    if hasattr(record, "numbers") and hasattr(record, "positions"):
        return atoms_to_record(record)
    raise ValueError(f"record must be a dict of arrays or an ase.Atoms, got {type(record).__name__}")


class RecordWriter:
    """Appends records to a store file; `commit()` makes them visible to readers atomically.

    compression: "none", "zstd" or "lz4" (per record; a record that would not shrink is stored
    uncompressed). positions_dtype: "float32" (default) or "float64". An existing file is opened
    for appending after its last commit unless overwrite=True, which builds a new file and renames
    it over `path` at the first commit (readers of the old file keep reading it; a crash before
    that commit leaves it whole). recover=True appends to a file whose newest header slot is
    damaged, after the last intact commit. Used as a context manager, a clean exit commits and
    closes; an exception closes without committing.
    """

    def __init__(self, path: str | os.PathLike, compression: str = "none", level: int = 3,
                 overwrite: bool = False, positions_dtype: str = "float32", recover: bool = False):
        if positions_dtype not in ("float32", "float64"):
            raise ValueError(f"positions_dtype must be 'float32' or 'float64', got {positions_dtype!r}")
        self._positions_dtype = np.dtype(positions_dtype)
        self._w = _C.StoreWriter(os.fspath(path), compression, level, overwrite, recover)
        self.path = os.fspath(path)

    def append(self, record) -> None:
        """Appends one record (a dict of arrays or an ase.Atoms)."""
        self._w.append(_check_record(dict(_as_record(record)), self._positions_dtype, None))

    def append_batch(self, records) -> None:
        """Appends many records: a sequence of records, or a dict of columns whose arrays share a
        leading record axis (every record then has the same shapes)."""
        if isinstance(records, Mapping):
            lengths = {len(np.asarray(v)) if np.ndim(v) else -1 for v in records.values()}
            if len(lengths) != 1 or -1 in lengths:
                raise ValueError("batch columns must all have the same leading record axis")
            count = lengths.pop()
            self._w.append_batch(_check_record(dict(records), self._positions_dtype, count), count)
            return
        if not isinstance(records, Iterable):
            raise ValueError("records must be a sequence of records or a dict of columns")
        for r in records:
            self.append(r)

    def commit(self) -> None:
        """Makes everything appended so far visible to readers, atomically and durably."""
        self._w.commit()

    def close(self) -> None:
        """Closes the file; records appended since the last commit are dropped."""
        self._w.close()

    def __len__(self) -> int:
        return len(self._w)

    @property
    def committed(self) -> int:
        return self._w.committed

    @property
    def generation(self) -> int:
        return self._w.generation

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._w.closed:
            self.commit()
        self.close()


class RecordReader(_C.StoreReader):
    """Reads a store file's last commit through mmap.

    `reader[i]` is a dict of numpy arrays (read-only, zero-copy for uncompressed records, valid as
    long as you hold them); 0-d numbers come back as numpy scalars and text as str.
    `read_batch(indices)` copies many records into one array per key: 0-d fields become [B],
    others are concatenated along their first axis with "_len_<key>" giving each record's length
    (stack=True stacks to [B, ...] instead). Safe to share between threads and across fork();
    picklable (it reopens by path).

    A file whose newest header slot is damaged raises ValueError (reading the previous commit
    could drop records); recover=True reads the last intact commit instead, with a
    RuntimeWarning. A missing file raises FileNotFoundError.
    """

    def __init__(self, path: str | os.PathLike, verify_checksums: bool = True, recover: bool = False):
        super().__init__(os.fspath(path), verify_checksums, recover)
        if self.header_warning:
            warnings.warn(self.header_warning, RuntimeWarning, stacklevel=2)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def atoms(self, index: int):
        """Record `index` as an ase.Atoms."""
        return record_to_atoms(self[index])

    def __reduce__(self):
        return (type(self), (self.path, self.verify_checksums, self.recover))

    def __repr__(self) -> str:
        return f"RecordReader({self.path!r}, records={len(self)}, generation={self.generation})"
