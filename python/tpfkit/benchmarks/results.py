"""What every benchmark's result rows carry (the commit measured, the date, the machine, the
device) and the JSON file they go to."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from typing import Optional

import torch


def git_commit(repo: Optional[str] = None, dirty: bool = False) -> str:
    """The commit being measured: TPF_COMMIT (set by scripts/gpu-check on the GPU machine to the
    commit its prebuilt kernels came from; that machine's copy of the tree may carry a stale .git),
    else git's HEAD in `repo` (default: the working directory), "-dirty" appended when asked and
    tracked files differ from it, else 'unknown'."""
    if os.environ.get("TPF_COMMIT"):
        return os.environ["TPF_COMMIT"]
    git = ["git", "-C", repo] if repo else ["git"]
    try:
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if dirty and subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip():
        sha += "-dirty"
    return sha


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every op benchmark takes: where (--device, --dtype), how long (--repeats) and
    where its rows go (--json); default_dtype reads --dtype."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write one row per implementation and shape")


def default_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """--dtype, else float32 on the CPU and bfloat16 on GPUs."""
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def metadata(device: torch.device) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"commit": git_commit(), "date": datetime.date.today().isoformat(),
            "machine": platform.node(), "device": str(device), "gpu": gpu}


def write_json(path: str, rows: list[dict], device: torch.device) -> None:
    """The rows, each with metadata(device), as one JSON list."""
    meta = metadata(device)
    with open(path, "w") as f:
        json.dump([{**r, **meta} for r in rows], f, indent=1)
