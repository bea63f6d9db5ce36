"""The record store's Python API: dicts of numpy arrays in, dicts of numpy arrays out.

A record is one complete structure: a dict from key to a numpy array (or a Python scalar / str).
Well-known keys (FORMAT.md, "Well-known keys") are checked for shape and dtype by the writer
itself, in C++; any other key holds any typed N-d array. FORMAT.md describes the bytes.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from tpfkit import _C

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
        self._w = _C.StoreWriter(os.fspath(path), compression, level, overwrite, recover,
                                 positions_dtype)
        self.path = os.fspath(path)

    def append(self, record) -> None:
        """Appends one record (a dict of arrays or an ase.Atoms)."""
        self._w.append(record if type(record) is dict else dict(_as_record(record)))

    def append_batch(self, records) -> None:
        """Appends many records: a sequence of records, or a dict of columns whose arrays share a
        leading record axis (every record then has the same shapes)."""
        if isinstance(records, Mapping):
            lengths = {len(np.asarray(v)) if np.ndim(v) else -1 for v in records.values()}
            if len(lengths) != 1 or -1 in lengths:
                raise ValueError("batch columns must all have the same leading record axis")
            count = lengths.pop()
            self._w.append_batch(dict(records), count)
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
    `read(i)` is the same with every array a writable copy of its own (copy=False: as reader[i]).
    `records(indices)` yields read(i) for each index in that order (all records when None); it
    loads the records a few steps ahead of the one it hands out, so a known shuffled order reads
    faster than the same read(i) calls one by one.
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
        return self.records(copy=False)

    def atoms(self, index: int):
        """Record `index` as an ase.Atoms."""
        return record_to_atoms(self[index])

    def __reduce__(self):
        return (type(self), (self.path, self.verify_checksums, self.recover))

    def __repr__(self) -> str:
        return f"RecordReader({self.path!r}, records={len(self)}, generation={self.generation})"
