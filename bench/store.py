"""Record store benchmark: TurboPairFormer's store against atompack-db, HDF5 (h5py), LMDB with
ASE/FAIR-Chem's row format, and ASE's SQLite database, all in one run on this machine.

Workload: the Atompack paper's synthetic 64-atom records (positions, atomic numbers, energy,
forces, cell, pbc). Each system writes every record, then reads them back as numpy arrays:
sequentially, and shuffled (indices the reading process never touched before, warm-up included)
with single-record calls and with batch calls, in 1 and 2 worker processes. Rates are the best of
--repeats measurements (the machine is shared), each bounded by --time-budget seconds; in-process
reads are also given per CPU-second of the reading process (`*_cpu_per_s`), which other load on
the machine disturbs far less than wall-clock time.

Not every system does the same work per read. TurboPairFormer verifies each record's XXH3-64
checksum on every read (its default, kept here); atompack-db keeps no per-record checksum (a byte
flipped in a stored record reads back silently, with either codec), so its reads skip that step.

    python bench/store.py --records 200000            # writes bench/results/store-<machine>.json + .png
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from typing import Callable

import numpy as np
from tqdm import tqdm

ATOMS = 64
CHUNK = 10_000

# ---- the workload -------------------------------------------------------------------------------


def make_columns(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "positions": rng.uniform(0, 10, (n, ATOMS, 3)).astype(np.float32),
        "atomic_numbers": rng.integers(1, 90, (n, ATOMS)).astype(np.uint8),
        "energy": rng.standard_normal(n),
        "forces": rng.standard_normal((n, ATOMS, 3)).astype(np.float32),
        "cell": np.broadcast_to(np.eye(3) * 10.0, (n, 3, 3)).copy(),
        "pbc": np.ones((n, 3), bool),
    }


# ---- systems: write(path, cols, codec) and open(path) -> (single(i), batch(idx)) ------------------
# Every read returns positions, atomic numbers, energy, forces, cell and pbc as numpy values.


class TurboPairFormer:
    impl = "turbopairformer"
    suffix = ".tpf"
    modules = ("turbopairformer.data",)

    @staticmethod
    def write(path, cols, codec):
        from turbopairformer.data import RecordWriter

        n = len(cols["energy"])
        with RecordWriter(path, compression=codec, overwrite=True) as w:
            for s in tqdm(range(0, n, CHUNK), desc="write turbopairformer", leave=False):
                w.append_batch({k: v[s:s + CHUNK] for k, v in cols.items()})

    @staticmethod
    def open(path):
        from turbopairformer.data import RecordReader

        r = RecordReader(path)
        return r.__getitem__, r.read_batch


class Atompack:
    impl = "atompack"
    suffix = ".atp"
    modules = ("atompack",)

    @staticmethod
    def write(path, cols, codec):
        import atompack

        n = len(cols["energy"])
        db = atompack.Database(path, compression=codec, overwrite=True)
        for s in tqdm(range(0, n, CHUNK), desc="write atompack", leave=False):
            sl = slice(s, s + CHUNK)
            db.add_arrays_batch(cols["positions"][sl], cols["atomic_numbers"][sl], energy=cols["energy"][sl],
                                forces=cols["forces"][sl], cell=cols["cell"][sl], pbc=cols["pbc"][sl])
        db.flush()

    @staticmethod
    def open(path):
        import atompack

        db = atompack.Database.open(path)

        def single(i):
            m = db[i]
            return m.positions, m.atomic_numbers, m.energy, m.forces, m.cell, m.pbc

        def batch(idx):
            return db.get_molecules_flat(idx.tolist())

        return single, batch


class HDF5:
    impl = "hdf5"
    suffix = ".h5"
    modules = ("h5py",)

    @staticmethod
    def write(path, cols, codec):
        import h5py

        n = len(cols["energy"])
        with h5py.File(path, "w") as f:
            ds = {k: f.create_dataset(k, shape=v.shape, dtype=v.dtype,
                                      chunks=(min(n, 256),) + v.shape[1:] if n else None)
                  for k, v in cols.items()}
            for s in tqdm(range(0, n, CHUNK), desc="write hdf5", leave=False):
                for k, v in cols.items():
                    ds[k][s:s + CHUNK] = v[s:s + CHUNK]

    @staticmethod
    def open(path):
        import h5py

        f = h5py.File(path, "r")
        ds = [f[k] for k in ("positions", "atomic_numbers", "energy", "forces", "cell", "pbc")]

        def single(i):
            return tuple(d[i] for d in ds)

        def batch(idx):
            # h5py reads a list of indices in increasing order only: read sorted, then put back.
            order = np.argsort(idx)
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(idx))
            sorted_idx = idx[order]
            return tuple(d[sorted_idx][inverse] for d in ds)

        return single, batch


class LmdbAse:
    """LMDB through the `lmdb` binding with FAIR-Chem's LMDBDatabase row format: one key per row
    (the id as ASCII), the value zlib(orjson(row dict)) as ASE's atoms2dict lays it out. Reads
    decode to numpy arrays (no Atoms object is built, which favours this system)."""
    impl = "lmdb_ase"
    suffix = ".lmdb"
    modules = ("lmdb", "orjson")
    envs: dict = {}

    @staticmethod
    def write(path, cols, codec):
        import lmdb
        import orjson

        n = len(cols["energy"])
        env = lmdb.open(path, map_size=1 << 36, subdir=False, meminit=False, map_async=True)
        now = time.time()
        for s in tqdm(range(0, n, CHUNK), desc="write lmdb_ase", leave=False):
            with env.begin(write=True) as txn:
                for i in range(s, min(n, s + CHUNK)):
                    row = {"numbers": cols["atomic_numbers"][i].astype(np.int64),
                           "positions": cols["positions"][i].astype(np.float64),
                           "cell": cols["cell"][i], "pbc": cols["pbc"][i],
                           "unique_id": uuid.uuid4().hex, "ctime": now, "mtime": now, "user": "bench",
                           "calculator": "unknown", "energy": float(cols["energy"][i]),
                           "forces": cols["forces"][i].astype(np.float64), "id": i + 1}
                    txn.put(f"{i + 1}".encode("ascii"),
                            zlib.compress(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY)))
        with env.begin(write=True) as txn:
            txn.put(b"nextid", orjson.dumps(n + 1))
        env.sync()
        env.close()

    @staticmethod
    def open(path):
        import lmdb
        import orjson

        # LMDB allows one environment per file and process: later handles share it.
        if path not in LmdbAse.envs:
            LmdbAse.envs[path] = lmdb.open(path, subdir=False, readonly=True, lock=False,
                                           readahead=False, meminit=False)
        txn = LmdbAse.envs[path].begin()

        def single(i):
            d = orjson.loads(zlib.decompress(txn.get(f"{i + 1}".encode("ascii"))))
            return (np.asarray(d["positions"]), np.asarray(d["numbers"]), d["energy"],
                    np.asarray(d["forces"]), np.asarray(d["cell"]), np.asarray(d["pbc"]))

        def batch(idx):
            return [single(int(i)) for i in idx]

        return single, batch


class AseSqlite:
    impl = "ase_sqlite"
    suffix = ".db"
    modules = ("ase", "ase.calculators.singlepoint", "ase.db")

    @staticmethod
    def write(path, cols, codec):
        from ase import Atoms
        from ase.calculators.singlepoint import SinglePointCalculator
        from ase.db import connect

        n = len(cols["energy"])
        db = connect(path, type="db", append=False)
        for s in tqdm(range(0, n, CHUNK), desc="write ase_sqlite", leave=False):
            with db:
                for i in range(s, min(n, s + CHUNK)):
                    a = Atoms(numbers=cols["atomic_numbers"][i], positions=cols["positions"][i],
                              cell=cols["cell"][i], pbc=cols["pbc"][i])
                    a.calc = SinglePointCalculator(a, energy=float(cols["energy"][i]), forces=cols["forces"][i])
                    db.write(a)

    @staticmethod
    def open(path):
        from ase.db import connect

        db = connect(path, type="db")

        def single(i):
            row = db.get(id=i + 1)
            return row.positions, row.numbers, row.energy, row.forces, row.cell, row.pbc

        def batch(idx):
            return [single(int(i)) for i in idx]

        return single, batch


SYSTEMS = {s.impl: s for s in (TurboPairFormer, Atompack, HDF5, LmdbAse, AseSqlite)}

# ---- measurement --------------------------------------------------------------------------------


def timed_reads(read_one: Callable, indices: np.ndarray, batch: int, budget: float) -> tuple[int, float, float]:
    """Reads `indices` (one call per index, or per `batch` indices) until done or `budget` seconds
    pass; returns (records read, wall seconds, CPU seconds of this process)."""
    done = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    if batch:
        for s in range(0, len(indices), batch):
            read_one(indices[s:s + batch])
            done += len(indices[s:s + batch])
            if time.perf_counter() - t0 > budget:
                break
    else:
        for k, i in enumerate(indices.tolist()):
            read_one(i)
            if (k & 63) == 63 and time.perf_counter() - t0 > budget:
                done = k + 1
                break
        else:
            done = len(indices)
    return done, time.perf_counter() - t0, time.process_time() - c0


def _worker(system_name, path, indices, batch, budget, warmup, barrier, queue):
    single, batched = SYSTEMS[system_name].open(path)
    fn = batched if batch else single
    timed_reads(fn, warmup, batch, budget)
    barrier.wait()
    start = time.perf_counter()
    done, _, _ = timed_reads(fn, indices, batch, budget)
    queue.put((done, start, time.perf_counter()))


def parallel_rate(system_name, path, indices, batch, budget, warmup, workers) -> float:
    """Records/s of `workers` fresh processes, each reading its share of `indices` after its own
    open and warm-up (which are not timed). Spawned, not forked: atompack's thread pool does not
    survive fork() in a process that already used it."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    queue = ctx.Queue()
    parts = np.array_split(indices, workers)
    procs = [ctx.Process(target=_worker, args=(system_name, path, part, batch, budget,
                                               warmup[w::workers], barrier, queue))
             for w, part in enumerate(parts)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{system_name} worker exited with {p.exitcode}")
    total = sum(r[0] for r in results)
    return total / (max(r[2] for r in results) - min(r[1] for r in results))


def du(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


READ_METRICS = ("seq_read_per_s", "shuffled_single_per_s", "shuffled_batch_per_s",
                "shuffled_single_2w_per_s", "shuffled_batch_2w_per_s",
                "seq_read_cpu_per_s", "shuffled_single_cpu_per_s", "shuffled_batch_cpu_per_s")


def write_system(system, cols, workdir, args) -> dict:
    """Writes the artifact (best of --repeats writes for systems that write in under 20 s)."""
    n = len(cols["energy"])
    path = os.path.join(workdir, system.impl + system.suffix)
    for module in system.modules:  # import time is not write time
        importlib.import_module(module)
    best = 0.0
    for rep in range(args.repeats):
        remove_artifact(path)
        t0 = time.perf_counter()
        system.write(path, cols, args.compression)
        seconds = time.perf_counter() - t0
        best = max(best, n / seconds)
        if seconds > 20:
            break
    return {"impl": system.impl, "records": n, "write_per_s": best, "bytes": du(path),
            "codec": args.compression, "path": path}


class ReadState:
    """One system's open handles and its supply of never-read shuffled indices."""

    def __init__(self, system, path, n, args, rng):
        self.system, self.path, self.args = system, path, args
        perm = rng.permutation(n)
        self.warm = perm[:args.warmup]
        self.fresh = perm[args.warmup:]
        # In this process, each shuffled measurement takes its own slice of never-read indices.
        # Worker processes start with nothing mapped, so each repeat's workers split all of them.
        measurements = args.repeats * 2
        per = max(1, min(args.read_sample, len(self.fresh) // measurements))
        self.slices = iter([self.fresh[k * per:(k + 1) * per] for k in range(measurements)])
        self.seq = np.arange(min(n, args.read_sample))
        self.single, self.batched = system.open(path)
        timed_reads(self.single, self.warm, 0, args.time_budget)
        timed_reads(self.batched, np.sort(self.warm), args.batch_size, args.time_budget)

    def measure(self) -> dict[str, float]:
        a = self.args
        out = {}
        # Wall-clock rates, and rates per CPU-second of this process (steadier on a shared machine).
        # The sequential pass gets a handle of its own: reading through the main handle would map
        # pages that the shuffled measurements are meant to touch for the first time.
        seq_single, _ = self.system.open(self.path)
        done, s, cpu = timed_reads(seq_single, self.seq, 0, a.time_budget)
        out["seq_read_per_s"], out["seq_read_cpu_per_s"] = done / s, done / cpu
        del seq_single
        done, s, cpu = timed_reads(self.single, next(self.slices), 0, a.time_budget)
        out["shuffled_single_per_s"], out["shuffled_single_cpu_per_s"] = done / s, done / cpu
        done, s, cpu = timed_reads(self.batched, next(self.slices), a.batch_size, a.time_budget)
        out["shuffled_batch_per_s"], out["shuffled_batch_cpu_per_s"] = done / s, done / cpu
        out["shuffled_single_2w_per_s"] = parallel_rate(self.system.impl, self.path, self.fresh, 0,
                                                        a.time_budget, self.warm, 2)
        out["shuffled_batch_2w_per_s"] = parallel_rate(self.system.impl, self.path, self.fresh,
                                                       a.batch_size, a.time_budget, self.warm, 2)
        return out


def remove_artifact(path: str) -> None:
    for p in (path, path + "-lock"):
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["impl"] for r in rows]
    metrics = [("seq_read_per_s", "sequential"), ("shuffled_single_per_s", "shuffled, single"),
               ("shuffled_batch_per_s", "shuffled, batch"), ("shuffled_single_2w_per_s", "shuffled, single, 2 workers"),
               ("shuffled_batch_2w_per_s", "shuffled, batch, 2 workers"),
               ("shuffled_single_cpu_per_s", "shuffled, single, per CPU-second"),
               ("shuffled_batch_cpu_per_s", "shuffled, batch, per CPU-second")]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [3, 1.2, 1.2]})
    x = np.arange(len(names))
    w = 0.12
    for k, (key, label) in enumerate(metrics):
        axes[0].bar(x + (k - 3) * w, [r[key] for r in rows], w, label=label,
                    hatch="//" if "cpu" in key else None)
    axes[0].set_yscale("log")
    axes[0].set_xticks(x, names)
    axes[0].set_ylabel("records / s (log)")
    axes[0].set_title(f"reads, {rows[0]['records']:,} records of {ATOMS} atoms")
    axes[0].legend(fontsize=8)
    axes[1].bar(x, [r["write_per_s"] for r in rows], color="tab:gray")
    axes[1].set_yscale("log")
    axes[1].set_xticks(x, names, rotation=30)
    axes[1].set_title("writes, records / s (log)")
    axes[2].bar(x, [r["bytes"] / 2**20 for r in rows], color="tab:brown")
    axes[2].set_xticks(x, names, rotation=30)
    axes[2].set_title(f"artifact size, MiB (codec {rows[0]['codec']})")
    fig.suptitle(f"record store benchmark, {rows[0]['machine']}, {rows[0]['date']}, commit {rows[0]['commit']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--compression", default="none", choices=["none", "zstd", "lz4"],
                   help="codec for turbopairformer and atompack (hdf5 and ase_sqlite store raw, lmdb_ase uses zlib)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--read-sample", type=int, default=100_000,
                   help="most records one in-process read measurement touches")
    p.add_argument("--time-budget", type=float, default=8.0, help="seconds one read measurement may take")
    p.add_argument("--warmup", type=int, default=2_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the artifacts go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the artifacts")
    p.add_argument("--json", default=None, help="output JSON (default bench/results/store-<machine>.json)")
    args = p.parse_args(argv)
    names = [s for s in args.systems.split(",") if s]
    for s in names:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.records < 1:
        p.error("--records must be >= 1")
    args.warmup = min(args.warmup, args.records // 10)

    date = datetime.date.today().isoformat()
    meta = {"commit": git_commit(), "machine": machine_name(), "date": date}
    host = platform.node() or "machine"
    out_json = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"store-{host}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)

    cols = make_columns(args.records, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    workdir = args.workdir or tempfile.mkdtemp(prefix="tpf-bench-store-")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    try:
        for name in tqdm(names, desc="write"):
            rows.append(write_system(SYSTEMS[name], cols, workdir, args))
        # Reads interleave the systems, repeat by repeat, so a burst of load on the shared machine
        # does not land on one system only; each metric keeps its best repeat.
        states = [ReadState(SYSTEMS[r["impl"]], r["path"], args.records, args, rng) for r in rows]
        for row in rows:
            row.update({m: 0.0 for m in READ_METRICS})
        for _ in tqdm(range(args.repeats), desc="read repeats"):
            for row, state in zip(rows, states):
                for m, v in state.measure().items():
                    row[m] = max(row[m], v)
        del states
        for row in rows:
            path = row.pop("path")
            row.update(meta)
            if not args.keep:
                remove_artifact(path)
            tqdm.write(json.dumps({k: (round(v) if isinstance(v, float) else v) for k, v in row.items()}))
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    settings = {k: getattr(args, k) for k in ("compression", "batch_size", "read_sample",
                                               "time_budget", "warmup", "repeats", "seed")}
    for row in rows:
        row["settings"] = settings
    with open(out_json, "w") as f:
        json.dump(rows, f, indent=2)
        f.write("\n")
    plot(rows, os.path.splitext(out_json)[0] + ".png")
    by = {r["impl"]: r for r in rows}
    if "turbopairformer" in by and "atompack" in by:
        ours, ap = by["turbopairformer"], by["atompack"]
        for key in ("write_per_s",) + READ_METRICS:
            print(f"{key:28s} turbopairformer / atompack = {ours[key] / ap[key]:.2f}x")
        print(f"{'bytes':28s} turbopairformer / atompack = {ours['bytes'] / ap['bytes']:.3f}")
    print(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
