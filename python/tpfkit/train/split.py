"""Which entries are held out for validation: a hash of the entry name, decided per record.

`tpf pack` writes each record's hash into the manifest (a shard's "entry_hash", FORMAT.md), so
`tpf train` knows the held-out records of a store, local or remote and of any size, from the
manifest alone: training starts at once and validation reads only the held-out records. A store
whose manifest has no hashes (packed before, or a bare shard) is split the same way by reading
the records' identifiers. Pure Python and numpy: builds without the record store use it too.
"""
from __future__ import annotations

import base64
import zlib
from typing import Any, Mapping, Optional, Sequence

import numpy as np

BUCKETS = 10_000  # an entry is held out when crc32(name) % BUCKETS < val_fraction * BUCKETS


def entry_bucket(entry: str) -> int:
    return zlib.crc32(entry.encode()) % BUCKETS


def held_out_bucket(bucket, val_fraction: float):
    """Whether a bucket (or an array of them) is held out at val_fraction."""
    return bucket < val_fraction * BUCKETS


def _text(a) -> np.ndarray:
    a = np.asarray(a)
    return np.char.decode(a, "ascii", "replace") if a.dtype.kind == "S" else a.astype(str)


def record_entry(record: Mapping[str, Any]) -> str:
    """The entry a record belongs to: its identifier, less "_<chain>" for a per-chain record
    (`tpf pack --per-chain` names them "<entry>_<chain>"), so an entry's chains stay together."""
    identifier = str(record.get("identifier", "record"))
    if "chain_id" in record:
        chain_ids = _text(record["chain_id"]).reshape(-1)
        if len(chain_ids) and (chain_ids == chain_ids[0]).all() and \
                identifier.endswith("_" + chain_ids[0]):
            return identifier[:-len(chain_ids[0]) - 1]
    return identifier


def encode_entry_hashes(buckets: Sequence[int]) -> str:
    """A shard's "entry_hash": base64 of one little-endian u16 bucket per record."""
    return base64.b64encode(np.asarray(buckets, dtype="<u2").tobytes()).decode("ascii")


def decode_entry_hashes(text: str, records: int) -> np.ndarray:
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 2 * records:
        raise ValueError(f"entry_hash holds {len(raw) // 2} records' hashes, the shard {records}")
    buckets = np.frombuffer(raw, dtype="<u2").astype(np.int64)
    if (buckets >= BUCKETS).any():
        raise ValueError(f"entry_hash holds a bucket >= {BUCKETS}")
    return buckets


def manifest_buckets(manifest: Mapping[str, Any]) -> Optional[np.ndarray]:
    """Every record's bucket, in dataset order, from a manifest whose shards all carry
    "entry_hash"; None when one does not (a store packed before the field existed)."""
    parts = []
    for shard in manifest.get("shards", []):
        if not isinstance(shard.get("entry_hash"), str):
            return None
        parts.append(decode_entry_hashes(shard["entry_hash"], int(shard["records"])))
    return np.concatenate(parts) if parts else None
