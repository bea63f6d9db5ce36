"""Checkpoints: model, optimizer, schedule and loader state plus the step, written atomically."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import torch

_NAME = re.compile(r"checkpoint-(\d+)\.pt$")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"checkpoint-{step:07d}.pt"


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler, config: dict, data: dict) -> Path:
    """Writes checkpoint-<step>.pt in run_dir (`data`: where the loader stands, so a resumed run
    sees the same batches); a crash mid-write leaves the previous ones intact."""
    path = checkpoint_path(run_dir, step)
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "config": config, "data": data}, tmp)
    os.replace(tmp, path)
    return path


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = [(int(m.group(1)), p) for p in run_dir.glob("checkpoint-*.pt")
             if (m := _NAME.search(p.name))]
    return max(found)[1] if found else None


def load_checkpoint(path: str) -> dict:
    """A checkpoint file, or the newest checkpoint of a run directory."""
    p = Path(path)
    if p.is_dir():
        found = latest_checkpoint(p)
        if found is None:
            raise FileNotFoundError(f"run directory {path!r} holds no checkpoint-*.pt")
        p = found
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    state = torch.load(p, map_location="cpu", weights_only=True)
    missing = {"step", "model", "optimizer", "scheduler", "config", "data"} - set(state)
    if missing:
        raise ValueError(f"checkpoint {str(p)!r} lacks {sorted(missing)}: not written by tpf train")
    return state
