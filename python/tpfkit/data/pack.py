"""`tpf pack`: structure files (mmCIF/PDB, extxyz) to store shards plus a dataset manifest."""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os

from tqdm import tqdm

from tpfkit import _C
from tpfkit.data.store import RecordWriter
from tpfkit.data.structures import file_kind, file_records
from tpfkit.train.split import encode_entry_hashes, entry_bucket, record_entry

MANIFEST_FORMAT = "tpfkit-manifest"
MANIFEST_VERSION = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="structure files or directories (searched recursively)")
    p.add_argument("-o", "--output", required=True, help="output directory for shards and manifest.json")
    p.add_argument("--compression", default="zstd", choices=["none", "zstd", "lz4"])
    p.add_argument("--level", type=int, default=3, help="zstd level (1..19)")
    p.add_argument("--shard-records", type=int, default=50_000, help="records per shard file")
    p.add_argument("--per-chain", action="store_true", help="one record per polymer chain (mmCIF/PDB)")
    p.add_argument("--positions-dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--base-url", default=None,
                   help="if set, each shard also gets url = BASE_URL/<file name> in the manifest")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def collect_inputs(inputs: list[str]) -> list[str]:
    files = []
    for item in inputs:
        if os.path.isdir(item):
            for root, _, names in os.walk(item):
                files += [os.path.join(root, n) for n in sorted(names) if file_kind(n)]
        elif os.path.exists(item):
            if not file_kind(item):
                raise ValueError(f"input {item} is not mmCIF/PDB (.cif .mmcif .pdb .ent) or extxyz (.xyz .extxyz)")
            files.append(item)
        else:
            raise FileNotFoundError(f"input {item} does not exist")
    if not files:
        raise ValueError("no mmCIF/PDB or extxyz files among the inputs")
    return sorted(files)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pack(files: list[str], output: str, compression: str = "zstd", level: int = 3,
         shard_records: int = 50_000, per_chain: bool = False, positions_dtype: str = "float32",
         base_url: str | None = None, progress: bool = True) -> dict:
    """Writes shards shard-NNNNN.tpf and manifest.json into `output`; returns the manifest."""
    records = (rec for path in tqdm(files, desc="pack", unit="file", disable=not progress)
               for rec in file_records(path, per_chain=per_chain))
    return pack_records(records, output, compression, level, shard_records, positions_dtype,
                        base_url)


def pack_records(records, output: str, compression: str = "zstd", level: int = 3,
                 shard_records: int = 50_000, positions_dtype: str = "float32",
                 base_url: str | None = None) -> dict:
    """Writes records (dicts of arrays, each with its "identifier") into shards
    shard-NNNNN.tpf and manifest.json in `output`, as pack does; returns the manifest."""
    if shard_records < 1:
        raise ValueError(f"shard_records must be >= 1, got {shard_records}")
    os.makedirs(output, exist_ok=True)
    shard_paths: list[str] = []
    buckets: list[list[int]] = []  # per shard, each record's entry hash (train/split.py)
    writer = None

    def open_next() -> RecordWriter:
        path = os.path.join(output, f"shard-{len(shard_paths):05d}.tpf")
        shard_paths.append(path)
        buckets.append([])
        return RecordWriter(path, compression=compression, level=level, overwrite=True,
                            positions_dtype=positions_dtype)

    for rec in records:
        if writer is None or len(writer) >= shard_records:
            if writer is not None:
                writer.commit()
                writer.close()
            writer = open_next()
        writer.append(rec)
        buckets[-1].append(entry_bucket(record_entry(rec)))
    if writer is None:
        raise ValueError("the inputs hold no atoms to pack")
    writer.commit()
    writer.close()

    shards = []
    for path, shard_buckets in zip(shard_paths, buckets):
        reader = _C.StoreReader(path, True)
        entry = {"path": os.path.basename(path), "records": len(reader),
                 "bytes": os.path.getsize(path), "sha256": sha256_of(path),
                 "generation": reader.generation}
        if base_url:
            entry["url"] = base_url.rstrip("/") + "/" + os.path.basename(path)
        # The hold-out of `tpf train` without reading the records (FORMAT.md, train/split.py).
        entry["entry_hash"] = encode_entry_hashes(shard_buckets)
        shards.append(entry)
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "manifest_sha256": "0" * 64,
        "store_format_version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "compression": compression,
        "records": sum(s["records"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "shards": shards,
    }
    write_manifest(manifest, os.path.join(output, "manifest.json"))
    return manifest


def write_manifest(manifest: dict, path: str) -> None:
    """Writes `manifest` (version 2) with its manifest_sha256 (FORMAT.md), which readers check,
    through a temporary file renamed into place."""
    manifest["version"] = MANIFEST_VERSION
    manifest["manifest_sha256"] = "0" * 64
    text = json.dumps(manifest, indent=2) + "\n"
    manifest["manifest_sha256"] = _C.stream_manifest_digest(text)
    text = text.replace('"manifest_sha256": "' + "0" * 64 + '"',
                        '"manifest_sha256": "' + manifest["manifest_sha256"] + '"', 1)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    files = collect_inputs(args.inputs)
    m = pack(files, args.output, args.compression, args.level, args.shard_records, args.per_chain,
             args.positions_dtype, args.base_url, progress=not args.quiet)
    print(f"packed {m['records']} records from {len(files)} files into {len(m['shards'])} shard(s), "
          f"{m['bytes']} bytes: {os.path.join(args.output, 'manifest.json')}")
    return 0
