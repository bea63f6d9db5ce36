"""Record store benchmark: TurboPairFormer's store against atompack-db, in one run on this machine.

Workload: --records random 64-atom records (positions float32 [64, 3], forces float32 [64, 3],
atomic numbers uint8 [64], energy float64), as in the Atompack paper's synthetic set. Reads use
one shuffled order of all records, the same for both systems in every repeat, on a warm cache
(every record is read once by both before any timing). Each repeat measures every mode for both
systems back to back (their order alternating), so a burst of load on the shared machine falls on
both; a mode's rate is the median of --repeats repeats, with the spread (min, max) and the
per-repeat ratio ours / atompack (its median, min and max) in the JSON.

What each mode measures (records/s; every read copies each array out of the store into memory
the caller owns, which reads every stored byte, and hands out all four values):
  single_copy   one call per record, in the shuffled order: ours `reader.read(i)` (a dict of
                arrays of their own), atompack `db[i]` then .positions, .atomic_numbers, .forces
                (each a new array built from the stored bytes) and .energy.
  single_order  the same records one at a time, the shuffled order given up front: ours
                `reader.records(order)` (loads a few records ahead of the one it hands out),
                atompack `db.get_molecules(order[k:k+256])` then the same four values of each.
  batch_copy    batches of --batch-size records in the shuffled order: ours `read_batch(idx)`
                (one concatenated array per key), atompack `get_molecules_flat(idx)`.
  write_single  one append call per record, from dicts of arrays built before timing, then one
                commit: ours `append(dict)` + commit (+ close), atompack
                `add_molecule(Molecule.from_arrays(...))` + flush.
  write_batch   columns of 10,000 records per call: ours `append_batch`, atompack
                `add_arrays_batch`, then commit / flush.
Not the same work per read: ours checks each record's XXH3-64 checksum on every read (the
default, kept here); atompack-db keeps no per-record checksum, so its reads skip that step.
Writes go to --workdir, by default on tmpfs (/dev/shm), so they measure the append path and not
the disk: ours fdatasyncs at commit, which costs nothing there.

    python bench/store.py            # writes bench/results/store-vm.json and .png (--json elsewhere)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

ATOMS = 64
CHUNK = 10_000
MODES = {
    "single_copy": "shuffled single-record reads, one call per record, every array copied out",
    "single_order": "the same records one at a time with the shuffled order given up front",
    "batch_copy": "shuffled batches of --batch-size records, one array per key, copied out",
    "write_single": "one append call per record, then one commit",
    "write_batch": "appends of 10,000-record columns, then one commit",
}
READ_MODES = ("single_copy", "single_order", "batch_copy")


def make_columns(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "positions": rng.uniform(0, 10, (n, ATOMS, 3)).astype(np.float32),
        "atomic_numbers": rng.integers(1, 90, (n, ATOMS)).astype(np.uint8),
        "forces": rng.standard_normal((n, ATOMS, 3)).astype(np.float32),
        "energy": rng.standard_normal(n),
    }


def make_records(cols: dict[str, np.ndarray]) -> list[dict]:
    return [{"positions": cols["positions"][i], "atomic_numbers": cols["atomic_numbers"][i],
             "forces": cols["forces"][i], "energy": float(cols["energy"][i])}
            for i in range(len(cols["energy"]))]


# ---- the two systems: writes, and reads returning (positions, numbers, forces, energy) ----------


class TurboPairFormer:
    name = "tpfkit"
    suffix = ".tpf"

    @staticmethod
    def write_single(path, records, codec):
        from tpfkit.data import RecordWriter

        with RecordWriter(path, compression=codec, overwrite=True) as w:
            for r in records:
                w.append(r)

    @staticmethod
    def write_batch(path, cols, codec):
        from tpfkit.data import RecordWriter

        n = len(cols["energy"])
        with RecordWriter(path, compression=codec, overwrite=True) as w:
            for s in range(0, n, CHUNK):
                w.append_batch({k: v[s:s + CHUNK] for k, v in cols.items()})

    @staticmethod
    def open(path):
        from tpfkit.data import RecordReader

        return RecordReader(path)

    @staticmethod
    def single_copy(r, order):
        for i in order:
            d = r.read(i)
            p, z, f, e = d["positions"], d["atomic_numbers"], d["forces"], d["energy"]

    @staticmethod
    def single_order(r, order):
        for d in r.records(order):
            p, z, f, e = d["positions"], d["atomic_numbers"], d["forces"], d["energy"]

    @staticmethod
    def batch_copy(r, order, batch):
        for s in range(0, len(order), batch):
            r.read_batch(order[s:s + batch])

    @staticmethod
    def one(r, i):
        d = r.read(int(i))
        return d["positions"], d["atomic_numbers"], d["forces"], float(d["energy"])

    @staticmethod
    def one_batch(r, idx):
        d = r.read_batch(idx)
        return d["positions"], d["atomic_numbers"], d["forces"], d["energy"]


class Atompack:
    name = "atompack"
    suffix = ".atp"

    @staticmethod
    def write_single(path, records, codec):
        import atompack

        db = atompack.Database(path, compression=codec, overwrite=True)
        for r in records:
            db.add_molecule(atompack.Molecule.from_arrays(r["positions"], r["atomic_numbers"],
                                                          energy=r["energy"], forces=r["forces"]))
        db.flush()

    @staticmethod
    def write_batch(path, cols, codec):
        import atompack

        n = len(cols["energy"])
        db = atompack.Database(path, compression=codec, overwrite=True)
        for s in range(0, n, CHUNK):
            sl = slice(s, s + CHUNK)
            db.add_arrays_batch(cols["positions"][sl], cols["atomic_numbers"][sl],
                                energy=cols["energy"][sl], forces=cols["forces"][sl])
        db.flush()

    @staticmethod
    def open(path):
        import atompack

        return atompack.Database.open(path)

    @staticmethod
    def single_copy(db, order):
        for i in order:
            m = db[i]
            p, z, f, e = m.positions, m.atomic_numbers, m.forces, m.energy

    @staticmethod
    def single_order(db, order):
        for s in range(0, len(order), 256):
            for m in db.get_molecules(order[s:s + 256]):
                p, z, f, e = m.positions, m.atomic_numbers, m.forces, m.energy

    @staticmethod
    def batch_copy(db, order, batch):
        for s in range(0, len(order), batch):
            db.get_molecules_flat(order[s:s + batch])

    @staticmethod
    def one(db, i):
        m = db[int(i)]
        return m.positions, m.atomic_numbers, m.forces, m.energy

    @staticmethod
    def one_batch(db, idx):
        d = db.get_molecules_flat(idx)
        return d["positions"], d["atomic_numbers"], d["forces"], d["energy"]


SYSTEMS = (TurboPairFormer, Atompack)


def check_reads(system, handle, cols, order, batch):
    """Outside the timing: the values read are the ones written, and every array read is a copy
    of its own (two reads of a record share no memory)."""
    keys = ("positions", "atomic_numbers", "forces")
    for i in order[:200]:
        got = system.one(handle, i)
        again = system.one(handle, i)
        for k, g, a in zip(keys, got, again):
            assert np.array_equal(g, cols[k][i]), f"{system.name}: record {i} {k} differs"
            assert not np.shares_memory(g, a), f"{system.name}: {k} of record {i} is not a copy"
        assert got[3] == cols["energy"][i], f"{system.name}: record {i} energy differs"
    idx = order[:batch]
    got = system.one_batch(handle, idx)
    for k, g in zip(keys, got):
        assert np.array_equal(np.asarray(g).reshape(cols[k][idx].shape), cols[k][idx]), \
            f"{system.name}: batch {k} differs"
    assert np.array_equal(got[3], cols["energy"][idx]), f"{system.name}: batch energy differs"


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of fn()."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def machine_name() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores)"


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "repeats": values}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = result["settings"]["codecs"]
    modes = list(MODES)
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    x = np.arange(len(modes))
    w = 0.8 / len(codecs)
    for c, codec in enumerate(codecs):
        rows = {r["mode"]: r for r in result["ratios"] if r["codec"] == codec}
        med = [rows[m]["median"] for m in modes]
        lo = [rows[m]["median"] - rows[m]["min"] for m in modes]
        hi = [rows[m]["max"] - rows[m]["median"] for m in modes]
        axes[0].bar(x + (c - (len(codecs) - 1) / 2) * w, med, w, yerr=[lo, hi], capsize=3,
                    label=f"codec {codec}")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(1.5, color="tab:red", lw=0.8, ls="--", label="1.5x")
    axes[0].set_xticks(x, modes, rotation=15)
    axes[0].set_ylabel("tpfkit / atompack-db (per-repeat ratio: median, min-max)")
    axes[0].legend(fontsize=8)
    axes[0].set_title("rate ratio (higher is better for us)")
    w = 0.8 / (2 * len(codecs))
    k = 0
    for codec in codecs:
        for system in ("tpfkit", "atompack"):
            rows = {r["mode"]: r for r in result["results"]
                    if r["codec"] == codec and r["system"] == system}
            axes[1].bar(x + (k - (2 * len(codecs) - 1) / 2) * w, [rows[m]["median"] for m in modes],
                        w, label=f"{system}, {codec}", hatch="//" if system == "atompack" else None)
            k += 1
    axes[1].set_yscale("log")
    axes[1].set_xticks(x, modes, rotation=15)
    axes[1].set_ylabel("records / s (median, log)")
    axes[1].legend(fontsize=8)
    axes[1].set_title(f"{result['settings']['records']:,} records of {ATOMS} atoms")
    fig.suptitle(f"record store, {result['machine']}, {result['date']}, commit {result['commit']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--codecs", default="none,zstd", help="comma-separated: none, zstd, lz4")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None,
                   help="where the files go (default: a fresh directory under /dev/shm, else /tmp)")
    p.add_argument("--json", default=None,
                   help="output JSON (default bench/results/store-vm.json, the 2-core VM's; a .png "
                        "beside it)")
    args = p.parse_args(argv)
    codecs = [c for c in args.codecs.split(",") if c]
    for c in codecs:
        if c not in ("none", "zstd", "lz4"):
            p.error(f"unknown codec {c!r}; choose from none, zstd, lz4")
    if args.records < args.batch_size or args.repeats < 1:
        p.error("--records must be >= --batch-size and --repeats >= 1")

    date = datetime.date.today().isoformat()
    out_json = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         "store-vm.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    base = args.workdir or tempfile.mkdtemp(prefix="tpf-bench-store-",
                                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(base, exist_ok=True)

    cols = make_columns(args.records, args.seed)
    records = make_records(cols)
    order = np.random.default_rng(args.seed + 1).permutation(args.records)
    order_list = order.tolist()
    rates: dict = {}   # (codec, mode, system) -> [records/s per repeat]
    cpu: dict = {}
    sizes: dict = {}
    try:
        handles = {}
        for codec in codecs:
            for system in SYSTEMS:
                path = os.path.join(base, f"{system.name}-{codec}{system.suffix}")
                system.write_batch(path, cols, codec)
                sizes.setdefault(codec, {})[system.name] = os.path.getsize(path)
                h = system.open(path)
                check_reads(system, h, cols, order, args.batch_size)
                system.single_copy(h, order_list)  # warm: page cache and page tables
                handles[codec, system.name] = h
        steps = args.repeats * len(codecs) * len(MODES)
        with tqdm(total=steps, desc="repeats x codecs x modes") as bar:
            for rep in range(args.repeats):
                systems = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
                for codec in codecs:
                    for mode in MODES:
                        for system in systems:
                            h = handles[codec, system.name]
                            scratch = os.path.join(base, f"w-{system.name}-{codec}{system.suffix}")
                            if mode == "single_copy":
                                fn = lambda: system.single_copy(h, order_list)  # noqa: E731
                            elif mode == "single_order":
                                arg = order if system is TurboPairFormer else order_list
                                fn = lambda: system.single_order(h, arg)  # noqa: E731
                            elif mode == "batch_copy":
                                fn = lambda: system.batch_copy(h, order, args.batch_size)  # noqa: E731
                            elif mode == "write_single":
                                fn = lambda: system.write_single(scratch, records, codec)  # noqa: E731
                            else:
                                fn = lambda: system.write_batch(scratch, cols, codec)  # noqa: E731
                            wall, cpu_s = timed(fn)
                            rates.setdefault((codec, mode, system.name), []).append(args.records / wall)
                            cpu.setdefault((codec, mode, system.name), []).append(args.records / cpu_s)
                            if mode.startswith("write"):
                                size = os.path.getsize(scratch)
                                if size != sizes[codec][system.name]:
                                    sizes.setdefault(f"{codec}-{mode}", {})[system.name] = size
                                os.remove(scratch)
                        bar.update()
        del handles
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)

    from tpfkit.benchmarks.results import git_commit

    commit = git_commit(os.path.dirname(os.path.abspath(__file__)), dirty=True)
    results, ratios = [], []
    for (codec, mode, system), values in rates.items():
        results.append({"codec": codec, "mode": mode, "system": system, "unit": "records/s",
                        **summarize(values), "cpu_median": statistics.median(cpu[codec, mode, system])})
    for codec in codecs:
        for mode in MODES:
            ours, theirs = rates[codec, mode, "tpfkit"], rates[codec, mode, "atompack"]
            per = [a / b for a, b in zip(ours, theirs)]
            ratios.append({"codec": codec, "mode": mode, **summarize(per),
                           "ratio_of_medians": statistics.median(ours) / statistics.median(theirs)})
    result = {
        "benchmark": "store", "commit": commit, "machine": machine_name(), "date": date,
        "python": platform.python_version(),
        "atompack_version": __import__("importlib.metadata").metadata.version("atompack-db"),
        "settings": {"records": args.records, "atoms": ATOMS, "codecs": codecs,
                     "batch_size": args.batch_size, "repeats": args.repeats, "seed": args.seed,
                     "workdir": "tmpfs" if base.startswith("/dev/shm") else base},
        "modes": MODES,
        "notes": ["rates are wall-clock records/s; cpu_median is records per CPU-second of this process",
                  "ours verifies every record's XXH3-64 checksum on read; atompack-db has none",
                  "ratios are tpfkit / atompack-db per repeat (adjacent measurements)"],
        "sizes_bytes": sizes, "results": results, "ratios": ratios,
    }
    with open(out_json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    plot(result, os.path.splitext(out_json)[0] + ".png")
    for r in ratios:
        print(f"{r['codec']:5s} {r['mode']:13s} ours / atompack = {r['median']:.2f}x "
              f"(per repeat {r['min']:.2f}-{r['max']:.2f})")
    for codec, by in sizes.items():
        print(f"{codec:5s} bytes: ours {by['tpfkit']:,}, atompack {by['atompack']:,} "
              f"({by['tpfkit'] / by['atompack']:.3f})")
    print(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
