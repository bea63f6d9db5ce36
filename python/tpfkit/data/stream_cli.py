"""`tpf stream SOURCE`: reads a dataset through StreamingDataset and reports its throughput."""
from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm


# last_stats' counters of what went wrong on the way, as `tpf stream` names them.
FAULT_COUNTERS = {"retries": "retries", "refetches": "records refetched (checksum)",
                  "full_body_answers": "200-for-206 answers read",
                  "multi_range_refused": "multi-range requests refused",
                  "single_range_spells": "single-range spells",
                  "multi_range_probes": "multi-range probes"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="manifest (path or http(s)/s3 URL), or a shard location")
    parser.add_argument("--cache-mib", type=float, default=256, help="memory budget in MiB")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shuffle", action="store_true", help="read records in stored order")
    parser.add_argument("--block-size", type=int, default=0,
                        help="shuffle blocks of this many neighbouring records (0: full shuffle)")
    parser.add_argument("--max-inflight", type=int, default=None,
                        help="range requests in flight (default: the loader's)")
    parser.add_argument("--limit", type=int, default=0, help="stop each epoch after N records")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        return _stream(args)
    except RuntimeError as e:  # I/O that failed after its retries: the message names the URL
        print(f"tpf stream: error: {e}", file=sys.stderr)
        return 2


def _stream(args: argparse.Namespace) -> int:
    from tpfkit.data.streaming import StreamingDataset

    ds = StreamingDataset(args.source, cache_bytes=int(args.cache_mib * 2**20),
                          shuffle=not args.no_shuffle, seed=args.seed, rank=0, world_size=1,
                          block_size=args.block_size,
                          **({} if args.max_inflight is None else {"max_inflight": args.max_inflight}))
    per_epoch = len(ds) if args.limit <= 0 else min(args.limit, len(ds))
    records = fetched = requests = 0
    faults = dict.fromkeys(FAULT_COUNTERS, 0)
    start = time.perf_counter()
    with tqdm(total=per_epoch * args.epochs, unit="rec", disable=args.quiet) as bar:
        for epoch in range(args.epochs):
            ds.set_epoch(epoch)
            it = iter(ds)
            for n, _ in enumerate(it, 1):
                bar.update(1)
                if n >= per_epoch:
                    break
            it.close()
            records += per_epoch
            fetched += ds.last_stats["bytes_fetched"]
            requests += ds.last_stats["requests"]
            faults["refetches"] += ds.last_stats["refetches"]
    elapsed = time.perf_counter() - start
    print(f"{records} records in {elapsed:.2f} s: {records / elapsed:,.0f} records/s, "
          f"{fetched / elapsed / 2**20:.1f} MiB/s fetched in {requests} requests "
          f"({ds.num_records} records, budget {args.cache_mib:g} MiB)")
    # The sources' counters include the faults met while opening the shards.
    faults.update({k: v for k, v in ds.source_stats.items() if k in faults})
    for m in ds.manifests:
        print(f"manifest {m['location']}: " + ("manifest_sha256 verified" if m["verified"] else
                                               "no manifest_sha256 (version 1), not verified")
              + (f", read {m['downloads']} times (a download failed its checks)"
                 if m["downloads"] > 1 else ""))
    print("faults met: " + ", ".join(f"{label} {faults[key]}" for key, label in FAULT_COUNTERS.items()))
    return 0
