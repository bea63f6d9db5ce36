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
    failed = [m[:400] for m in re.findall(r"^(?:FAILED|ERROR) (.+)$", proc.stdout, flags=re.M)]
    if proc.returncode not in (0, 1, 5):  # 1: some tests failed (reported per test); 5: none selected
        # A collection error or a crash: reported as a failure of those files, with pytest's last
        # lines, and the sweep goes on.
        tail = (proc.stdout[-1500:] + proc.stderr[-1500:]).strip().replace("\n", " | ")
        failed.append(f"{' '.join(paths)}: pytest exited with {proc.returncode}: {tail}")
    return failed


def read_log(path):
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            rows.append(json.loads(line))
    return rows


def git_commit():
    if os.environ.get("TPF_COMMIT"):  # the commit a copy without its .git was built from
        return os.environ["TPF_COMMIT"]
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
    p.add_argument("--shards", type=int, default=1,
                   help="split the tests into this many groups, a pytest process per group and "
                        "chunk of seeds (smaller jobs: the GPU suite's one seed is ~250 core-s)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds: start no chunk after this (the report says how many ran)")
    p.add_argument("--out", default=None, help="report path without extension")
    p.add_argument("--tests", default=None,
                   help="file listing the accuracy tests (one node id per line, as a sweep writes to "
                        "OUT.tests.txt): skips the discovery run")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="combine sweep reports (e.g. thread counts swept on different runs) into "
                        "one report at --out: per test the worst ratio, runs added")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args, argv)

    paths = ["tests/gpu"] if args.gpu else ["tests/python"]
    kind = "gpu" if args.gpu else "cpu"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"accuracy-sweep-{kind}"
    extra = ["-k", args.keyword] if args.keyword else []
    threads = [int(t) for t in args.threads.split(",")]
    # More threads than cores makes OpenMP's spinning threads thrash (on a 12-core share, 12 jobs
    # at 4 threads finished no chunk in 9 minutes): jobs x threads stays within this process's cores.
    cores = len(os.sched_getaffinity(0))
    if args.jobs * max(threads) > cores:
        jobs = max(1, cores // max(threads))
        print(f"--jobs {args.jobs} x {max(threads)} threads > {cores} cores: {jobs} jobs", flush=True)
        args.jobs = jobs
    t0 = time.time()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        suite_failures = []
        if args.tests:
            tests = sorted(set(Path(args.tests).read_text().split()))
        else:
            # The whole suite once at its default seeds (a test file per process, --jobs at a
            # time): its failures are reported too, and its accuracy checks name the tests.
            files = sorted(str(f.relative_to(ROOT)) for d in paths for f in (ROOT / d).glob("test_*.py"))
            def discover(i):
                log = tmp / f"discover-{i}.jsonl"
                return run_pytest([files[i]], extra, {}, log), read_log(log)
            with futures.ThreadPoolExecutor(args.jobs) as pool:
                found = list(pool.map(discover, range(len(files))))
            suite_failures = [f for failed, _ in found for f in failed]
            tests = sorted({without_seed_id(r["test"]) for _, got in found for r in got})
        if not tests:
            raise SystemExit("no accuracy test ran (no GPU here? use the CPU sweep)")
        paths = sorted({t.split("::")[0] for t in tests})  # collect only their files
        listed = out.with_suffix(".tests.txt")
        listed.parent.mkdir(parents=True, exist_ok=True)
        listed.write_text("\n".join(tests) + "\n")
        print(f"{len(tests)} accuracy tests; {args.seeds} seeds x threads {threads}", flush=True)

        # Shards deal the tests round-robin (neighbours in the sorted list are alike in cost).
        shards = [tests[i::args.shards] for i in range(min(args.shards, len(tests)))]
        for i, shard in enumerate(shards):
            (tmp / f"shard-{i}.txt").write_text("\n".join(shard) + "\n")
        jobs = []
        for t in threads:
            for first in range(args.start, args.start + args.seeds, args.chunk):
                count = min(args.chunk, args.start + args.seeds - first)
                jobs += [(t, first, count, i) for i in range(len(shards))]
        failures, rows = [], []
        try:
            from tqdm import tqdm
        except ImportError:  # the progress bar is optional
            tqdm = None
        bar = tqdm(total=len(jobs), unit="chunk") if tqdm else None

        def one(job):
            t, first, count, shard = job
            if args.deadline and time.time() - t0 > args.deadline:
                return t, [], None
            log = tmp / f"t{t}-s{first}-{shard}.jsonl"
            env = {"TPF_SEED": str(first), "OMP_NUM_THREADS": str(t), "TPF_NUM_THREADS": str(t)}
            failed = run_pytest(paths, extra + ["--only-tests", str(tmp / f"shard-{shard}.txt"),
                                                "--seeds", str(count)], env, log)
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
        "failures": failures, "suite_failures": suite_failures, "never_checked": missing,
        "suite_run": not args.tests, "per_test": table,
    }
    return write(report, out, kind, args.chunk)


def write(report, out, kind, chunk):
    """The report as JSON, a markdown table and a plot; the exit status (1 on any failure)."""
    table, failures = report["per_test"], report["failures"]
    suite_failures, threads = report["suite_failures"], report["threads"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    runs = [r["runs"] for r in table]  # (seed, threads) pairs each test ran under
    lines = [f"# Accuracy sweep ({kind}): {report['command']}", "",
             f"{report['machine']}, commit {report['commit']}, {report['date']}, "
             f"{report['seconds']} s; seeds {report['seeds'][0]}..{report['seeds'][1]} planned, "
             f"{min(runs) if runs else 0}-{max(runs) if runs else 0} runs per test, threads "
             f"{threads}; {report['tests']} tests; {report['chunks_run']} of {report['chunks_planned']} chunks of "
             f"{chunk} seeds ran; worst ratio {report['worst_ratio'] or 0:.3f}; "
             f"{len(failures)} failures; " + (
                 f"the whole suite at its default seeds first: {len(suite_failures)} failures"
                 if report.get("suite_run", True) else "the suite itself not run (--tests)"), "",
             "| test | worst error / bound | tensor | seed | threads | runs |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['test']} | {r['worst_ratio']:.3f} | {r['tensor']} | {r['seed']} | "
              f"{r['threads']} | {r['runs']} |" for r in table]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(table, out.with_suffix(".png"), report)
    print("\n".join(lines[:2] + lines[2:3] + lines[4:6] + lines[6:11]))
    for f in (failures + [f"{f} (the suite at its default seeds)" for f in suite_failures])[:30]:
        print("FAILED", f)
    return 1 if failures or suite_failures or (table and table[0]["worst_ratio"] > 1) else 0




def merge(args, argv):
    """One report from several (--merge): per test its worst ratio over them, runs and checks
    added; machines, commits, seeds and thread counts listed."""
    reports = [json.loads(Path(f).read_text()) for f in args.merge]
    worst = {}
    for r in reports:
        for row in r["per_test"]:
            if "test_accuracy_rule.py" in row["test"]:
                continue  # the rule's self-tests (wrong results on purpose), logged by older sweeps
            w = worst.get(row["test"])
            if w is None:
                worst[row["test"]] = dict(row)
            else:
                runs, checks = w["runs"] + row["runs"], w["checks"] + row["checks"]
                if row["worst_ratio"] > w["worst_ratio"]:
                    w.update(row)
                w.update(runs=runs, checks=checks)
    table = sorted(worst.values(), key=lambda r: -r["worst_ratio"])
    first = reports[0]
    report = {
        "what": first["what"],
        "command": "python tests/sweep_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "merged": [{k: r[k] for k in ("command", "machine", "commit", "date", "seeds", "threads",
                                      "seconds", "chunks_run", "chunks_planned", "worst_ratio")}
                   for r in reports],
        "machine": " + ".join(sorted({r["machine"] for r in reports})),
        "commit": " + ".join(sorted({r["commit"] for r in reports})),
        "date": max(r["date"] for r in reports),
        "seeds": [min(r["seeds"][0] for r in reports), max(r["seeds"][1] for r in reports)],
        "threads": sorted({t for r in reports for t in r["threads"]}),
        "seconds": round(sum(r["seconds"] for r in reports), 1),
        "tests": len(table),
        "chunks_run": sum(r["chunks_run"] for r in reports),
        "chunks_planned": sum(r["chunks_planned"] for r in reports),
        "worst_ratio": table[0]["worst_ratio"] if table else None,
        "failures": [f for r in reports for f in r["failures"]],
        "suite_failures": [f for r in reports for f in r.get("suite_failures", [])],
        "suite_run": any(r.get("suite_run", True) for r in reports),
        "never_checked": sorted({t for r in reports for t in r["never_checked"]} - set(worst)),
        "per_test": table,
    }
    kind = "gpu" if "gpu" in first["command"].split() or "--gpu" in first["command"] else "cpu"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"accuracy-sweep-{kind}"
    return write(report, out, kind, "several")


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
