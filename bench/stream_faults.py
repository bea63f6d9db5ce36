"""FoldPipe under faults: shuffled epochs through the fault-injecting server of the tests
(tests/python/stream_harness.py, Python's http.server on 127.0.0.1) with no faults and with a
fraction of range requests given a fault (503, reset, a body cut short, a byte flipped in transit,
200 with the whole file for a range request, in turn). Every record of every epoch is checked
against what was written (once each, same arrays); the rate is records/s over the epoch, the two
fault rates interleaved, median of the repeats. The server is the same in both, so the ratio is
what the faults cost the loader (the absolute rates are the Python server's, far below nginx's).

    python bench/stream_faults.py --repeats 3 --json bench/results/stream-faults-vm.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))


def epoch(url: str, reference: list[dict], seed: int, epoch_index: int, args) -> dict:
    from tpfkit.data import StreamingDataset

    ds = StreamingDataset(url, cache_bytes=args.budget_mib << 20, seed=seed, backoff_base_s=0.01,
                          backoff_max_s=0.2, verify_backoff_base_s=0.01, verify_backoff_max_s=0.2)
    ds.set_epoch(epoch_index)
    seen = np.zeros(len(reference), dtype=np.int64)
    t0 = time.perf_counter()
    for record in ds:
        i = int(record["id"])
        seen[i] += 1
        if not (np.array_equal(record["positions"], reference[i]["positions"])
                and np.array_equal(record["numbers"], reference[i]["numbers"])):
            raise AssertionError(f"record {i} differs from what was written")
    elapsed = time.perf_counter() - t0
    if not (seen == 1).all():
        raise AssertionError(f"records not delivered exactly once: {np.flatnonzero(seen != 1)[:10]}")
    stats = ds.last_stats
    return {"records_per_s": len(reference) / elapsed, "seconds": elapsed,
            **{k: stats[k] for k in ("requests", "retries", "refetches", "full_body_answers",
                                     "multi_range_refused", "single_range_spells")}}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(result["median_records_per_s"], key=float)
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    values = [result["median_records_per_s"][r] for r in rates]
    ax.bar([f"{float(r):.0%} faults" for r in rates], values, color=["tab:blue", "tab:orange"])
    for x, v in enumerate(values):
        ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("records/s (median)")
    ax.set_title(f"FoldPipe epoch under faults: {result['ratio']:.0%} of the fault-free rate",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    import stream_harness as h
    from tpfkit.benchmarks.results import git_commit

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--records-per-shard", type=int, default=2500)
    p.add_argument("--rate", type=float, default=0.05, help="share of range requests with a fault")
    p.add_argument("--budget-mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here (and a .png beside it)")
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    directory = tempfile.mkdtemp(prefix="tpf-bench-faults-")
    reference = h.write_dataset(directory, rng, shards=args.shards,
                                records_per_shard=args.records_per_shard, max_atoms=64)
    runs = {"0": [], str(args.rate): []}
    with h.FaultServer(directory) as server:
        url = server.url + "/manifest.json"
        for repeat in range(args.repeats):
            for rate in (0.0, args.rate):
                server.random_faults(rate, args.seed + repeat)
                before = dict(server.served_faults)
                row = epoch(url, reference, args.seed, repeat, args)
                row["faults_served"] = {k: v - before.get(k, 0) for k, v in
                                        server.served_faults.items() if v - before.get(k, 0)}
                runs["0" if rate == 0 else str(rate)].append(row)
                print(f"repeat {repeat} faults {rate:.0%}: {row['records_per_s']:,.0f} records/s, "
                      f"{row['requests']} requests, {row['retries']} retries, "
                      f"{row['refetches']} refetches, {row['full_body_answers']} 200-for-206 read, "
                      f"faults {row['faults_served']}", flush=True)
    medians = {rate: statistics.median(r["records_per_s"] for r in rows) for rate, rows in runs.items()}
    result = {
        "benchmark": "stream_faults", "machine": platform.node(), "cpu_count": os.cpu_count(),
        "commit": git_commit(REPO), "date": datetime.date.today().isoformat(),
        "records": len(reference), "shards": args.shards, "budget_mib": args.budget_mib,
        "fault_kinds": list(h.SOAK_FAULTS), "what": "one shuffled epoch per run, every record "
        "checked once and equal to what was written; records/s over the epoch; rates interleaved",
        "runs": runs, "median_records_per_s": medians,
        "ratio": medians[str(args.rate)] / medians["0"],
    }
    print(f"median: {medians['0']:,.0f} records/s without faults, {medians[str(args.rate)]:,.0f} "
          f"with {args.rate:.0%}: {result['ratio']:.0%} of the fault-free rate")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(args.json)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
