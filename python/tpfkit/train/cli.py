"""`tpf train`: train a PairFormer trunk to predict distograms of real protein chains.

The defaults are the CPU main job: a small trunk that runs in a minute or two on 2 cores and whose
loss falls measurably. Writes metrics.jsonl, loss.png, config.json and checkpoints into --out.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import fields

from tpfkit.nn import BACKENDS
from tpfkit.train.loop import PRECISIONS, SCHEDULES, TrainConfig, train
from tpfkit.train.model import ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d, m = TrainConfig(), ModelConfig()
    data = parser.add_argument_group("data")
    data.add_argument("--data", default=d.data,
                      help="record-store shards streamed through FoldPipe (a directory with "
                           "manifest.json, a manifest or a shard file, local or an http(s):// or "
                           "s3:// URL), or chains held in memory (a directory of mmCIF/PDB files, "
                           "a .npz of chains) (default: %(default)s)")
    data.add_argument("--crop", type=int, default=d.crop, help="residues per crop (default: %(default)s)")
    data.add_argument("--batch-size", type=int, default=d.batch_size, help="(default: %(default)s)")
    data.add_argument("--val-fraction", type=float, default=d.val_fraction,
                      help="share of entries held out for the validation loss (default: %(default)s)")
    data.add_argument("--val-records", type=int, default=d.val_records,
                      help="a record store's held-out records read for the validation loss, the "
                           "first in store order; only they are read (default: %(default)s)")
    data.add_argument("--cache-mib", type=float, default=d.cache_mib,
                      help="the streaming loader's memory budget in MiB (default: %(default)s)")
    data.add_argument("--loader-workers", type=int, default=d.loader_workers,
                      help="DataLoader processes turning streamed records into chains "
                           "(default: %(default)s)")
    model = parser.add_argument_group("model (taken from the checkpoint when resuming)")
    model.add_argument("--blocks", type=int, default=m.blocks, help="(default: %(default)s)")
    model.add_argument("--c-z", type=int, default=m.c_z, help="pair channels (default: %(default)s)")
    model.add_argument("--heads", type=int, default=m.heads, help="(default: %(default)s)")
    model.add_argument("--head-dim", type=int, default=m.head_dim, help="(default: %(default)s)")
    model.add_argument("--transition-n", type=int, default=m.transition_n,
                       help="transition width as a multiple of c_z (default: %(default)s)")
    model.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute each block in the backward to save memory")
    opt = parser.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, default=d.steps, help="(default: %(default)s)")
    opt.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    opt.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps (default: %(default)s)")
    opt.add_argument("--schedule", choices=SCHEDULES, default=d.schedule,
                     help="after warm-up (default: %(default)s)")
    opt.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                     help="cosine schedule's final learning rate over the peak (default: %(default)s)")
    opt.add_argument("--grad-clip", type=float, default=d.grad_clip, help="(default: %(default)s)")
    opt.add_argument("--seed", type=int, default=d.seed, help="weights and data order (default: %(default)s)")
    run = parser.add_argument_group("run")
    run.add_argument("--backend", choices=BACKENDS, default=d.backend, help="(default: %(default)s)")
    run.add_argument("--compile", action="store_true",
                     help="run each PairFormer block under torch.compile (either backend)")
    run.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    run.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                     help="bf16 = bfloat16 autocast (default: %(default)s)")
    run.add_argument("--out", default=d.out, help="run directory (default: %(default)s)")
    run.add_argument("--resume", default=None, metavar="PATH",
                     help="checkpoint file or run directory (its newest checkpoint) to continue from")
    run.add_argument("--eval-every", type=int, default=d.eval_every, help="(default: %(default)s)")
    run.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                     help="(default: %(default)s)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--json", default=None, metavar="FILE", help="also write the summary as JSON")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    model = ModelConfig(blocks=args.blocks, c_z=args.c_z, heads=args.heads, head_dim=args.head_dim,
                        transition_n=args.transition_n, checkpoint=args.activation_checkpointing)
    names = {f.name for f in fields(TrainConfig)} - {"model"}
    return TrainConfig(model=model, **{n: getattr(args, n) for n in names})


def run(args: argparse.Namespace) -> int:
    summary = train(config_from_args(args), resume=args.resume, progress=not args.no_progress)
    print(f"trained {summary['steps']} steps on {summary['train_data']} "
          f"(median {summary['median_step_ms']:.0f} ms/step)")
    loader = summary["loader"]
    if loader.get("records_per_s"):
        print(f"loader: {loader['records']} records streamed at {loader['records_per_s']:,.0f} "
              f"records/s ({loader['wait_s']:.2f} s waiting for them; retries {loader['retries']}, "
              f"refetches {loader['refetches']} in the last epoch)")
    print(f"train loss: {summary['first_loss']:.3f} (first {summary['window']} steps) -> "
          f"{summary['final_loss']:.3f} (last {summary['window']} steps)")
    if summary["val_loss_end"] is not None:
        print(f"held-out loss ({summary['val_chains']} chains): {summary['val_loss_start']:.3f} -> "
              f"{summary['val_loss_end']:.3f}")
    if summary["nonfinite_steps"]:
        print(f"non-finite loss or gradient (update skipped) at steps {summary['nonfinite_steps']}")
    print(f"final loss: {summary['final_loss']:.3f}")
    print(f"loss plot: {summary['plot']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0
