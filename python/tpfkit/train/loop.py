"""The training loop of `tpf train`: steps, schedule, evaluation, checkpoints, metrics and the plot."""
from __future__ import annotations

import json
import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from tpfkit.nn._layers import check_backend
from tpfkit.train.checkpoint import load_checkpoint, save_checkpoint
from tpfkit.train.data import (
    CropBatches,
    MemoryChains,
    StreamedChains,
    TrainSide,
    fixed_batches,
    held_out_chains,
    load_chains,
    record_store_location,
    split_by_entry,
)
from tpfkit.train.model import DistogramModel, ModelConfig

SCHEDULES = ("constant", "cosine")
PRECISIONS = ("fp32", "bf16")


@dataclass
class TrainConfig:
    data: str = "data/structures"
    out: str = "runs/main"
    steps: int = 400
    batch_size: int = 4
    crop: int = 48
    lr: float = 1.8e-3
    warmup: int = 40
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 10.0
    backend: str = "reference"
    compile: bool = False
    device: str = "cpu"
    precision: str = "fp32"
    seed: int = 0
    val_fraction: float = 0.1
    val_records: int = 256  # a record store's held-out records read for the validation loss
    cache_mib: float = 64.0  # the loader's memory budget (StreamingDataset's cache_bytes)
    loader_workers: int = 0  # DataLoader processes that turn records into chains
    eval_every: int = 100
    checkpoint_every: int = 100
    model: ModelConfig = field(default_factory=ModelConfig)

    def validate(self) -> "TrainConfig":
        check_backend(self.backend)
        for name in ("steps", "batch_size", "crop", "eval_every", "checkpoint_every", "val_records"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.cache_mib <= 0 or self.loader_workers < 0:
            raise ValueError(f"cache_mib must be > 0 and loader_workers >= 0, got {self.cache_mib} "
                             f"and {self.loader_workers}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "TrainConfig":
        d = {k: v for k, v in d.items() if k in {f.name for f in fields(TrainConfig)}}
        d["model"] = ModelConfig(**d["model"])
        return TrainConfig(**d)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then constant or cosine down to min_lr_ratio."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """Adam with AlphaFold3's betas and epsilon (one fused kernel on GPUs: the same update as the
    per-parameter loop, without its hundreds of launches), and the warm-up schedule as a LambdaLR."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                           fused=torch.device(cfg.device).type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


class Trainer:
    """One run: the model, its optimizer, the data; `step()` does one update and returns its row."""

    def __init__(self, cfg: TrainConfig, chains=None, progress: bool = True):
        self.cfg = cfg.validate()
        self.device = torch.device(cfg.device)
        torch.manual_seed(cfg.seed)
        location = None if chains is not None else record_store_location(cfg.data)
        if location is None:
            # Chains in memory: a .npz or structure files (builds without the record store).
            if chains is None:
                chains = load_chains(cfg.data, progress=progress)
            train_chains, self._val_chains = split_by_entry(chains, cfg.val_fraction)
            self.chains = MemoryChains(train_chains, cfg.seed)
            self.train_size = f"{len(train_chains)} chains"
        else:
            # A record store: streamed from the first step, held-out entries skipped. The
            # held-out chains (middle crops, fixed) are read when validation first runs: only
            # the held-out records, which the manifest's entry hashes name (train/split.py).
            if not 0 <= cfg.val_fraction < 1:
                raise ValueError(f"val_fraction must be in [0, 1), got {cfg.val_fraction}")
            self.chains = StreamedChains(location, cfg.seed, int(cfg.cache_mib * 2**20),
                                         TrainSide(cfg.val_fraction), cfg.loader_workers)
            self.train_size = f"a stream of {self.chains.dataset.num_records} records"
            self._location, self._progress = location, progress
            self._val_chains = None
        self.batches = CropBatches(self.chains, cfg.batch_size, cfg.crop, cfg.seed)
        self._val_batches = None
        self.model = DistogramModel(cfg.model, cfg.backend).to(self.device)
        if cfg.compile:
            # One graph per block, shared by the blocks (same code, parameters as inputs); the
            # turbo ops stay opaque custom ops inside it, the code around them is fused.
            for block in self.model.pairformer.blocks:
                block.compile()
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg)
        self.step_count = 0

    @property
    def val_chains(self) -> list:
        """The held-out chains (a record store's are read here, the first time)."""
        if self._val_chains is None:
            self._val_chains = held_out_chains(self.chains.dataset, self._location,
                                               self.cfg.val_fraction, self.cfg.val_records,
                                               progress=self._progress)
        return self._val_chains

    @property
    def val_batches(self) -> list[dict]:
        if self._val_batches is None:
            self._val_batches = fixed_batches(self.val_chains, self.cfg.batch_size, self.cfg.crop)
        return self._val_batches

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.chains.load_state_dict(state["data"])
        self.step_count = int(state["step"])

    def step(self) -> dict:
        self.model.train()
        t0 = time.perf_counter()
        batch = to_device(self.batches.next(), self.device)
        with autocast(self.cfg, self.device):
            loss = self.model.loss(batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        # A non-finite step is reported and skipped, as AlphaFold3 does, so one bad batch does
        # not poison the weights.
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step_count += 1
        loss_value = loss.item()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"step": self.step_count, "loss": loss_value, "lr": lr,
                "grad_norm": grad_norm.item(), "finite": finite,
                "step_ms": (time.perf_counter() - t0) * 1e3}

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """Mean loss over the held-out chains (middle crops), or None when there are none."""
        if not self.val_batches:
            return None
        self.model.eval()
        losses = []
        for batch in self.val_batches:
            with autocast(self.cfg, self.device):
                losses.append(self.model.loss(to_device(batch, self.device)).item())
        return statistics.fmean(losses)


def _read_metrics(path: Path, upto_step: int) -> list[dict]:
    """The metric rows of an earlier run up to a step (later rows belong to a run being replaced)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto_step]


def plot_metrics(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        steps = [r["step"] for r in train]
        losses = [r["loss"] for r in train]
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train loss (per step)")
        window = max(1, min(25, len(losses) // 10))
        smooth = [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label=f"train loss ({window}-step mean)")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color="tab:orange",
                label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("distogram cross-entropy (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train(cfg: TrainConfig, resume: Optional[str] = None, progress: bool = True) -> dict:
    """Runs cfg.steps updates (continuing from a checkpoint when resume is given); writes
    metrics.jsonl, loss.png and checkpoints into cfg.out; returns a summary."""
    state = None
    if resume is not None:
        state = load_checkpoint(resume)
        saved = TrainConfig.from_dict(state["config"])
        cfg.model = saved.model  # the weights fix the model's shape
    trainer = Trainer(cfg, progress=progress)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if state is not None:
        trainer.load_state(state)
        rows = _read_metrics(out / "metrics.jsonl", trainer.step_count)
    if trainer.step_count >= cfg.steps:
        raise ValueError(f"steps ({cfg.steps}) must exceed the checkpoint's step ({trainer.step_count})")
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    metrics = open(out / "metrics.jsonl", "w")
    for r in rows:
        metrics.write(json.dumps(r) + "\n")

    def log(row: dict) -> None:
        rows.append(row)
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()

    if trainer.step_count == 0:
        log({"step": 0, "val_loss": trainer.evaluate()})
    bar = tqdm(total=cfg.steps, initial=trainer.step_count, desc="tpf train", unit="step",
               disable=not progress, dynamic_ncols=True)
    nonfinite = []
    with metrics, bar:
        while trainer.step_count < cfg.steps:
            row = trainer.step()
            log(row)
            if not row["finite"]:
                nonfinite.append(row["step"])
            bar.set_postfix(loss=f"{row['loss']:.3f}", ms=f"{row['step_ms']:.0f}")
            bar.update(1)
            t = trainer.step_count
            if t % cfg.eval_every == 0 or t == cfg.steps:
                log({"step": t, "val_loss": trainer.evaluate()})
            if t % cfg.checkpoint_every == 0 or t == cfg.steps:
                save_checkpoint(out, t, trainer.model, trainer.optimizer, trainer.scheduler,
                                cfg.to_dict(), trainer.chains.state_dict())
    plot = out / "loss.png"
    m = cfg.model
    plot_metrics(rows, plot, f"tpf train: {m.blocks} blocks, c_z {m.c_z}, crop {cfg.crop}, "
                 f"{cfg.backend}, {cfg.precision}, {trainer.train_size}")
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if r.get("val_loss") is not None]
    k = max(1, min(20, len(train_rows) // 5))
    return {
        "steps": trainer.step_count,
        "first_loss": statistics.fmean(r["loss"] for r in train_rows[:k]),
        "final_loss": statistics.fmean(r["loss"] for r in train_rows[-k:]),
        "window": k,
        "val_loss_start": val_rows[0]["val_loss"] if val_rows else None,
        "val_loss_end": val_rows[-1]["val_loss"] if val_rows else None,
        "median_step_ms": statistics.median(r["step_ms"] for r in train_rows),
        "nonfinite_steps": nonfinite,
        "train_data": trainer.train_size,
        "val_chains": len(trainer.val_chains),
        "loader": trainer.chains.throughput(),
        "plot": str(plot),
        "metrics": str(out / "metrics.jsonl"),
    }
