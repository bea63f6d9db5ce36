#!/usr/bin/env python3
"""Runs every accuracy test (every test that checks a result through tests/python/accuracy.py) over
many seeds and thread counts and reports, per test, the worst ratio of error to bound.

    python tests/sweep_accuracy.py --seeds 200 --threads 1,2,4          # CPU tests
    python tests/sweep_accuracy.py --gpu --seeds 50 --threads 16 --jobs 4   # GPU tests

The accuracy tests are found by running the suite once with TPF_ACCURACY_LOG set (each check logs
its test); then each of them runs under seeds start..start+K-1 (`--seeds`, tests/conftest.py) at each
thread count (OMP_NUM_THREADS for PyTorch, TPF_NUM_THREADS for our CPU path). A ratio above 1 is a
failure; the suite's margin is the largest ratio. Writes the report as JSON, a markdown table and a
plot (--out, default bench/results/accuracy-sweep-<cpu|gpu>.*).
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))
from seeds import without_seed_id  # noqa: E402


def pytest_cmd(paths, extra):
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *paths, *extra]


def run_pytest(paths, extra, env_extra, log):
    env = dict(os.environ, TPF_ACCURACY_LOG=str(log), **env_extra)
    proc = subprocess.run(pytest_cmd(paths, extra), cwd=ROOT, env=env, capture_output=True,
                          text=True)
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, flags=re.M)
    if proc.returncode not in (0, 1):  # 1: some tests failed, reported per test
        raise RuntimeError(f"pytest exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return failed


def read_log(path):
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            rows.append(json.loads(line))
    return rows


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TPF_COMMIT", "unknown")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="sweep tests/gpu instead of tests/python")
    p.add_argument("--seeds", type=int, default=200, help="seeds per test and thread count")
    p.add_argument("--start", type=int, default=1, help="first seed")
    p.add_argument("--threads", default="1,2,4", help="thread counts, comma-separated")
    p.add_argument("--jobs", type=int, default=1, help="pytest processes at a time")
    p.add_argument("--chunk", type=int, default=10, help="seeds per pytest process")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds: start no chunk after this (the report says how many ran)")
    p.add_argument("--out", default=None, help="report path without extension")
    p.add_argument("--tests", default=None,
                   help="file listing the accuracy tests (one node id per line, as a sweep writes to "
                        "OUT.tests.txt): skips the discovery run")
    args = p.parse_args(argv)

    paths = ["tests/gpu"] if args.gpu else ["tests/python"]
    kind = "gpu" if args.gpu else "cpu"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"accuracy-sweep-{kind}"
    extra = ["-k", args.keyword] if args.keyword else []
    threads = [int(t) for t in args.threads.split(",")]
    t0 = time.time()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.tests:
            tests = sorted(set(Path(args.tests).read_text().split()))
            paths = sorted({t.split("::")[0] for t in tests})  # collect only their files
        else:
            discover = tmp / "discover.jsonl"
            run_pytest(paths, extra, {}, discover)
            tests = sorted({without_seed_id(r["test"]) for r in read_log(discover)})
        if not tests:
            raise SystemExit("no accuracy test ran (no GPU here? use the CPU sweep)")
        listed = out.with_suffix(".tests.txt")
        listed.parent.mkdir(parents=True, exist_ok=True)
        listed.write_text("\n".join(tests) + "\n")
        print(f"{len(tests)} accuracy tests; {args.seeds} seeds x threads {threads}", flush=True)

        jobs = []
        for t in threads:
            for first in range(args.start, args.start + args.seeds, args.chunk):
                count = min(args.chunk, args.start + args.seeds - first)
                jobs.append((t, first, count))
        failures, rows = [], []
        try:
            from tqdm import tqdm
        except ImportError:  # the progress bar is optional
            tqdm = None
        bar = tqdm(total=len(jobs), unit="chunk") if tqdm else None

        def one(job):
            t, first, count = job
            if args.deadline and time.time() - t0 > args.deadline:
                return t, [], None
            log = tmp / f"t{t}-s{first}.jsonl"
            env = {"TPF_SEED": str(first), "OMP_NUM_THREADS": str(t), "TPF_NUM_THREADS": str(t)}
            failed = run_pytest(paths, extra + ["--only-tests", str(listed), "--seeds", str(count)],
                                env, log)
            return t, failed, read_log(log)

        with futures.ThreadPoolExecutor(args.jobs) as pool:
            skipped = 0
            for t, failed, got in pool.map(one, jobs):
                if got is None:
                    skipped += 1
                    continue
                failures += [f"{f} (threads {t})" for f in failed]
                rows += got
                if bar:
                    bar.update()
        if bar:
            bar.close()

    worst = {}
    for r in rows:
        test = without_seed_id(r["test"])
        w = worst.setdefault(test, {"ratio": -1.0, "checks": 0, "seeds": set()})
        w["checks"] += 1
        w["seeds"].add((r["seed"], r["threads"]))
        if r["ratio"] > w["ratio"]:
            w.update(ratio=r["ratio"], tensor=r["tensor"], seed=r["seed"], threads=r["threads"])
    table = sorted(({"test": k, "worst_ratio": v["ratio"], "tensor": v["tensor"],
                     "seed": v["seed"], "threads": v["threads"], "runs": len(v["seeds"]),
                     "checks": v["checks"]} for k, v in worst.items()),
                   key=lambda r: -r["worst_ratio"])
    missing = sorted(set(tests) - set(worst))
    report = {
        "what": "worst error/bound of tests/python/accuracy.py's rule per accuracy test",
        "command": "python tests/sweep_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
        "commit": git_commit(), "date": datetime.date.today().isoformat(),
        "seeds": [args.start, args.start + args.seeds - 1], "threads": threads,
        "seconds": round(time.time() - t0, 1), "tests": len(tests),
        "chunks_run": len(jobs) - skipped, "chunks_planned": len(jobs),
        "worst_ratio": table[0]["worst_ratio"] if table else None,
        "failures": failures, "never_checked": missing, "per_test": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Accuracy sweep ({kind}): {report['command']}", "",
             f"{report['machine']}, commit {report['commit']}, {report['date']}, "
             f"{report['seconds']} s; seeds {report['seeds'][0]}..{report['seeds'][1]}, threads "
             f"{threads}; {len(tests)} tests; {report['chunks_run']} of {len(jobs)} chunks of "
             f"{args.chunk} seeds ran; worst ratio {report['worst_ratio']:.3f}; "
             f"{len(failures)} failures", "",
             "| test | worst error / bound | tensor | seed | threads | runs |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['test']} | {r['worst_ratio']:.3f} | {r['tensor']} | {r['seed']} | "
              f"{r['threads']} | {r['runs']} |" for r in table]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(table, out.with_suffix(".png"), report)
    print("\n".join(lines[:2] + lines[2:3] + lines[4:6] + lines[6:11]))
    for f in failures[:20]:
        print("FAILED", f)
    return 1 if failures or (table and table[0]["worst_ratio"] > 1) else 0


def plot(table, path, report):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ratios = [r["worst_ratio"] for r in table]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(ratios, bins=40, range=(0, max(1.05, max(ratios) * 1.05)), color="tab:blue")
    ax.axvline(0.8, color="tab:orange", ls="--", label="margin bar 0.8")
    ax.axvline(1.0, color="tab:red", ls="-", label="failure 1.0")
    ax.set_xlabel("worst error / bound over seeds and thread counts")
    ax.set_ylabel("tests")
    ax.set_title(f"accuracy sweep: {report['tests']} tests, seeds {report['seeds'][0]}.."
                 f"{report['seeds'][1]}, threads {report['threads']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
