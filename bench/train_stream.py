"""`tpf train` streaming its records over HTTP from nginx (scripts/gpu-check train-stream).

Serves a packed record store with nginx on 127.0.0.1 (TPF_NGINX names a carried one, else the
installed one), then runs, once per backend, the command a user runs:

    python -m tpfkit.cli train --data http://127.0.0.1:PORT/manifest.json --device D --steps N ...

and prints one JSON row per backend: loss over the first and last steps, median step time and
steps/s, the wall time of the whole command, how many requests nginx answered and how many
records the loader streamed. The store: --store DIR (a directory with manifest.json; on the GPU
machine the one scripts/build-device-data packs into its bundle), else data/structures packed here
with `tpf pack --per-chain`, as the main job packs it. Arguments this script does not know go to
`tpf train` (e.g. --crop 128 --precision bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))

from stream_harness import Nginx  # noqa: E402


def packed_store(store: str | None, work: str) -> str:
    if store:
        if not os.path.isfile(os.path.join(store, "manifest.json")):
            raise SystemExit(f"train_stream: {store} holds no manifest.json")
        return store
    out = os.path.join(work, "store")
    subprocess.run([sys.executable, "-m", "tpfkit.cli", "pack", os.path.join(REPO, "data", "structures"),
                    "-o", out, "--per-chain", "--quiet"], check=True)
    return out


def requests_served(log: str) -> int:
    try:
        with open(log) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", default=None, help="a packed store's directory (default: pack data/structures)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--backends", nargs="+", default=["turbo", "reference"])
    p.add_argument("--work", default=None, help="run directories and nginx's files (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args, train_args = p.parse_known_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="tpf-train-stream-")
    store = packed_store(args.store, work)
    rows = []
    with Nginx(store, os.path.join(work, "nginx"), access_log=True) as server:
        url = f"{server.url}/manifest.json"
        for backend in args.backends:
            out = os.path.join(work, f"run-{backend}")
            summary_file = os.path.join(work, f"summary-{backend}.json")
            cmd = [sys.executable, "-m", "tpfkit.cli", "train", "--data", url, "--device", args.device,
                   "--steps", str(args.steps), "--backend", backend, "--out", out, "--no-progress",
                   "--json", summary_file, *train_args]
            print("$ " + shlex.join(cmd), flush=True)
            before = requests_served(server.access_log)
            t0 = time.perf_counter()
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wall = time.perf_counter() - t0
            print(done.stdout.rstrip(), flush=True)
            if done.returncode != 0:
                rows.append({"backend": backend, "device": args.device, "rc": done.returncode})
                continue
            with open(summary_file) as f:
                s = json.load(f)
            rows.append({
                "backend": backend, "device": args.device, "data": url, "steps": s["steps"],
                "loss_start": round(s["first_loss"], 4), "loss_end": round(s["final_loss"], 4),
                "loss_window": s["window"], "val_loss_start": s["val_loss_start"],
                "val_loss_end": s["val_loss_end"], "median_step_ms": round(s["median_step_ms"], 2),
                "steps_per_s": round(1e3 / s["median_step_ms"], 2),
                "wall_s": round(wall, 1), "train_data": s["train_data"],
                "http_requests": requests_served(server.access_log) - before,
                "loader": s["loader"], "args": train_args, "rc": 0,
            })
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rows and all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
