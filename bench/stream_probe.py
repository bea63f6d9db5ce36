"""FoldPipe probe: one shuffled epoch streamed in this process (no DataLoader, no dict building
beyond the binding's dict of numpy arrays per record), with a sampler thread that records every `--interval` seconds the CPU time
of each of this process's threads (/proc/self/task, by thread name), of nginx and of the proxy, the
prefetcher's counters (requests done, records handed out, consumer waits and the time spent in
them, requests in flight and queued) and the records consumed. It prints per-thread CPU per record
and a time series summary, and writes everything as JSON.

    python bench/stream_probe.py --source http_5ms --budget-mib 256 --json /tmp/probe.json

Uses bench/stream.py's dataset (--data-dir) and its delaying proxy.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
sys.path.insert(0, HERE)

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, summed by thread name."""
    out: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
        except FileNotFoundError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[name if tid != str(os.getpid()) else "main"] += (int(fields[11]) + int(fields[12])) / TICK
    return dict(out)


def main() -> int:
    import stream as bench
    import stream_harness as h

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="http_5ms", choices=["local", "http", "http_5ms"])
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--block-size", type=int, default=0)
    p.add_argument("--records", type=int, default=600_000)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "tpf-bench-stream"))
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--nginx-workers", type=int, default=1)
    p.add_argument("--opt", action="append", default=[],
                   help="NAME=VALUE passed to StreamingDataset (e.g. http_threads=4)")
    p.add_argument("--perf", help="run `perf record -g` on this process into this file")
    p.add_argument("--json")
    args = p.parse_args()

    from tpfkit import _C
    from tpfkit.data import StreamingDataset

    manifest = bench.write_dataset(os.path.join(args.data_dir, "ds"), args.records, 50_000, 0)
    work = tempfile.mkdtemp(prefix="tpf-probe-nginx-")
    nginx = h.Nginx(os.path.join(args.data_dir, "ds"), work, workers=args.nginx_workers).__enter__()
    proxy_port = h.free_port()
    proxy = subprocess.Popen([sys.executable, os.path.join(HERE, "stream.py"), "--proxy",
                              str(proxy_port), str(nginx.port), str(args.latency_ms)])
    perf = None
    try:
        bench.wait_port(proxy_port)
        location = {"local": os.path.join(args.data_dir, "ds", "manifest.json"),
                    "http": f"{nginx.url}/manifest.json",
                    "http_5ms": f"http://127.0.0.1:{proxy_port}/manifest.json"}[args.source]
        servers = {"nginx": [nginx.proc.pid] + bench.children_of(nginx.proc.pid),
                   "proxy": [proxy.pid]}
        opts = {}
        for kv in args.opt:
            k, v = kv.split("=", 1)
            opts[k] = int(v)
        ds = StreamingDataset(location, cache_bytes=args.budget_mib << 20, seed=0,
                              block_size=args.block_size, **opts)
        ds.set_epoch(1)
        shards = ds._open()
        if args.perf:
            perf = subprocess.Popen(["perf", "record", "-g", "-F", "2000", "-o", args.perf, "-p",
                                     str(os.getpid())], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        samples = []
        count = [0]
        done = threading.Event()
        stream_box = []

        def sample() -> None:
            t0 = time.perf_counter()
            while not done.wait(args.interval):
                s = stream_box[0].stats() if stream_box else {}
                samples.append({"t": time.perf_counter() - t0, "records": count[0],
                                "threads": thread_cpu(),
                                "servers": {k: bench.cpu_seconds(v) for k, v in servers.items()},
                                "stats": dict(s)})

        http0 = _C.stream_http_stats()
        cpu0, srv0 = thread_cpu(), {k: bench.cpu_seconds(v) for k, v in servers.items()}
        sampler = threading.Thread(target=sample, name="probe-sampler")
        sampler.start()
        t0 = time.perf_counter()
        stream = shards.stream(ds._plan(), ds.cache_bytes, True)
        stream_box.append(stream)
        for _ in stream:
            count[0] += 1
            if args.limit and count[0] >= args.limit:
                break
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        stats = stream.stats()
        http = {k: v - http0[k] for k, v in _C.stream_http_stats().items()}
        cpu1, srv1 = thread_cpu(), {k: bench.cpu_seconds(v) for k, v in servers.items()}
    finally:
        if perf is not None:
            perf.send_signal(2)
            perf.wait(timeout=60)
        proxy.terminate()
        proxy.wait(timeout=10)
        nginx.__exit__(None, None, None)

    n = count[0]
    per_thread = {k: 1e6 * (cpu1.get(k, 0) - cpu0.get(k, 0)) / n for k in cpu1}
    per_server = {k: 1e6 * (srv1[k] - srv0[k]) / n for k in srv1}
    result = {"source": args.source, "budget_mib": args.budget_mib, "block_size": args.block_size,
              "records": n, "seconds": seconds, "records_per_s": n / seconds,
              "cpu_us_per_record": {"threads": per_thread, "servers": per_server},
              "wall_us_per_record": 1e6 * seconds / n, "stats": dict(stats), "http": http,
              "opts": opts,
              "samples": samples}
    print(f"{args.source} budget {args.budget_mib} MiB: {n} records in {seconds:.2f} s = "
          f"{n / seconds:,.0f} records/s (wall {1e6 * seconds / n:.2f} us/record)")
    print("  CPU us/record by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                  sorted(per_thread.items(), key=lambda kv: -kv[1])
                                                  if v > 0.005))
    print("  servers: " + ", ".join(f"{k} {v:.2f}" for k, v in per_server.items()))
    print("  stats: " + json.dumps(dict(stats)))
    req = max(stats["requests"], 1)
    print(f"  {stats['ranges'] / req:.1f} ranges and {stats['bytes_fetched'] / req / 1024:.0f} KiB "
          f"per request, {1e3 * stats['request_s'] / req:.1f} ms per request (start to end), "
          f"consumer waited {stats['consumer_wait_s']:.2f} s of {seconds:.2f} s "
          f"({stats['consumer_waits']} times), peak in flight {stats['peak_inflight']}")
    if http["attempts"]:
        a = http["attempts"]
        print(f"  HTTP attempts {a}: {1e3 * http['slot_wait_s'] / a:.1f} ms waiting for a "
              f"connection, {1e3 * http['first_byte_s'] / a:.1f} ms to the first byte, "
              f"{1e3 * http['attempt_s'] / a:.1f} ms to the end (means)")
    if len(samples) > 2:
        inflight = sorted(x["stats"].get("inflight", 0) for x in samples)
        print(f"  requests in flight over time: min {inflight[0]}, median "
              f"{inflight[len(inflight) // 2]}, max {inflight[-1]} ({len(samples)} samples)")
    # Busy fraction of each thread over the epoch (CPU seconds / wall seconds).
    print("  busy: " + ", ".join(f"{k} {(cpu1.get(k, 0) - cpu0.get(k, 0)) / seconds:.0%}"
                                 for k in sorted(cpu1) if cpu1.get(k, 0) - cpu0.get(k, 0) > 0.01))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
