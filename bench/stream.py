"""FoldPipe benchmark: shuffled epochs of a dataset several times larger than the memory budget,
read from local files, from nginx on loopback and from nginx behind a proxy that delays every
request by 5 ms; records/s and RSS sampled throughout, for each budget. LitData (PyPI) is measured
on the same records and budget when it is importable (`--peer-python` may name another venv's
python that has it). Every measurement runs in its own process, whose RSS the parent samples; the
CPU time of the loader, of nginx and of the proxy is measured too, because on one machine all three
share its cores (a remote server's would not).

    python bench/stream.py --repeats 3 --suffix NAME --json bench/results/stream-rows.json \
        --peer-python /path/to/venv-with-litdata/bin/python
"""
from __future__ import annotations

import argparse
import collections
import datetime
import fcntl
import heapq
import itertools
import json
import os
import platform
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))


# ---------------------------------------------------------------------------------------------
# The dataset: the Atompack paper's 64-atom workload (positions, numbers, energy, forces, cell, pbc)

def write_dataset(directory: str, records: int, shard_records: int, seed: int) -> dict:
    from tpfkit.data import RecordWriter
    from tpfkit.data.pack import MANIFEST_FORMAT

    manifest_path = os.path.join(directory, "manifest.json")
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("records") == records:
            return manifest
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, done = [], 0
    with tqdm(total=records, desc="write dataset", unit="rec") as bar:
        while done < records:
            count = min(shard_records, records - done)
            name = f"shard-{len(shards):05d}.tpf"
            path = os.path.join(directory, name)
            w = RecordWriter(path, compression="none", overwrite=True)
            for start in range(0, count, 10_000):
                b = min(10_000, count - start)
                w.append_batch({
                    "id": np.arange(done + start, done + start + b, dtype=np.int64),
                    "numbers": rng.integers(1, 90, size=(b, 64)).astype(np.int32),
                    "positions": rng.standard_normal((b, 64, 3)).astype(np.float32),
                    "forces": rng.standard_normal((b, 64, 3)).astype(np.float32),
                    "energy": rng.standard_normal(b),
                    "cell": np.tile(np.eye(3, dtype=np.float32) * 12, (b, 1, 1)),
                    "pbc": np.ones((b, 3), dtype=bool),
                })
                bar.update(b)
            w.commit()
            w.close()
            shards.append({"path": name, "records": count, "bytes": os.path.getsize(path)})
            done += count
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "records": records,
                "bytes": sum(s["bytes"] for s in shards), "shards": shards}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return manifest


def shuffle_quality(order: np.ndarray, batch: int = 64, regions: int = 100) -> dict:
    """How well an order mixes: distinct 1%-regions of the dataset per batch of 64 (a uniform
    shuffle gives about 47, reading in order 1), and the fraction of consecutive samples that are
    storage neighbours (uniform: about 2/N; in order: 1)."""
    n = len(order)
    region = order * regions // n
    usable = n // batch * batch
    per_batch = region[:usable].reshape(-1, batch)
    distinct = np.mean([len(np.unique(r)) for r in per_batch[: min(len(per_batch), 2000)]])
    neighbours = float(np.mean(np.abs(np.diff(order.astype(np.int64))) == 1))
    return {"regions_per_batch": float(distinct), "neighbour_fraction": neighbours}


# ---------------------------------------------------------------------------------------------
# A proxy that delays each request by a fixed time (per connection, in order)
#
# It shares the machine's cores with the loader and nginx, so it must cost little: one thread, an
# epoll loop, responses moved by the kernel (splice through a pipe, never copied into Python), and
# only the requests, a few hundred bytes each, read into Python to be held for the delay. An
# HTTP/1.1 client sends its next request on a connection only after the previous response, so
# holding each request adds the delay to every request's round trip. Its CPU time is reported.

_PIPE_BYTES = 1 << 20


class _Connection:
    """One client connection and its own connection to nginx."""

    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client, self.upstream = client, upstream
        self.pipe_r, self.pipe_w = os.pipe()
        fcntl.fcntl(self.pipe_w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        self.piped = 0                 # response bytes in the pipe, not yet sent to the client
        self.upstream_open = True      # nginx has not closed its side
        self.reading_upstream = False  # registered for responses (only while the pipe has room)
        self.writing_client = False    # registered for room to send (only while bytes are piped)
        self.requests: collections.deque[bytes] = collections.deque()  # held, in arrival order
        self.closed = False


def run_proxy(listen_port: int, upstream_port: int, delay_ms: float) -> None:
    delay_s = delay_ms / 1000
    sel = selectors.EpollSelector()
    # SO_REUSEPORT: several proxy processes may listen on the port, the kernel spreading the
    # connections over them (--proxy-workers).
    server = socket.create_server(("127.0.0.1", listen_port), backlog=1024, reuse_port=True)
    server.setblocking(False)
    sel.register(server, selectors.EVENT_READ)
    timers: list[tuple[float, int, _Connection]] = []  # (due, tie-break, connection)
    arrivals = itertools.count()

    def close(c: _Connection) -> None:
        if c.closed:
            return
        c.closed = True
        for sock in (c.client, c.upstream):
            try:
                sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        os.close(c.pipe_r)
        os.close(c.pipe_w)

    def update(c: _Connection) -> None:
        want_up = c.upstream_open and c.piped < _PIPE_BYTES
        if want_up != c.reading_upstream:
            (sel.register if want_up else sel.unregister)(*((c.upstream, selectors.EVENT_READ, c)
                                                            if want_up else (c.upstream,)))
            c.reading_upstream = want_up
        want_write = c.piped > 0
        if want_write != c.writing_client:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            sel.modify(c.client, events, c)
            c.writing_client = want_write

    def drain(c: _Connection) -> None:
        while c.piped:
            try:
                c.piped -= os.splice(c.pipe_r, c.client.fileno(), c.piped, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                return
        if not c.upstream_open:
            c.client.shutdown(socket.SHUT_WR)

    while True:
        timeout = max(0.0, timers[0][0] - time.monotonic()) if timers else None
        for key, events in sel.select(timeout):
            if key.fileobj is server:
                try:
                    client, _ = server.accept()
                    upstream = socket.create_connection(("127.0.0.1", upstream_port))
                except OSError:
                    continue
                for sock in (client, upstream):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setblocking(False)
                c = _Connection(client, upstream)
                sel.register(client, selectors.EVENT_READ, c)
                update(c)
                continue
            c = key.data
            if c.closed:
                continue
            try:
                if key.fileobj is c.upstream:
                    try:
                        n = os.splice(c.upstream.fileno(), c.pipe_w, _PIPE_BYTES - c.piped,
                                      flags=os.SPLICE_F_NONBLOCK)
                    except BlockingIOError:
                        n = -1
                    if n == 0:
                        c.upstream_open = False
                    elif n > 0:
                        c.piped += n
                    drain(c)
                else:
                    if events & selectors.EVENT_READ:
                        data = c.client.recv(1 << 16)
                        if not data:
                            close(c)
                            continue
                        c.requests.append(data)
                        heapq.heappush(timers, (time.monotonic() + delay_s, next(arrivals), c))
                    if events & selectors.EVENT_WRITE:
                        drain(c)
                update(c)
            except OSError:
                close(c)
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, c = heapq.heappop(timers)
            if c.closed:
                continue
            try:
                # A request is a few hundred bytes and nginx has read the previous one: the send
                # buffer has room, so this never blocks the loop.
                c.upstream.sendall(c.requests.popleft())
            except OSError:
                close(c)


# ---------------------------------------------------------------------------------------------
# One measurement, in a child process

def rss_mib(pid: int | None = None) -> float:
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRss:
    """Samples this process's RSS every 2 ms on a thread while in use: the streaming window only,
    not the imports before it (importing torch briefly peaks far above where it settles) nor the
    interpreter's teardown after it."""

    def __enter__(self) -> "PeakRss":
        self.peak = rss_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.wait(0.002):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


def child(args: argparse.Namespace) -> None:
    """Prints JSON lines: the baseline RSS before streaming, then records, seconds and peak RSS."""
    peak = PeakRss()
    if args.impl == "tpfkit":
        import torch  # noqa: F401  (imported before the baseline: every DataLoader user has it)

        from tpfkit.data import StreamingDataset

        def make():
            return StreamingDataset(args.location, cache_bytes=args.budget_mib << 20,
                                    seed=args.seed, shuffle=True, block_size=args.block_size,
                                    max_inflight=args.max_inflight,
                                    http_threads=args.http_threads,
                                    group_records=args.group_records,
                                    coalesce_gap=args.coalesce_gap)
        epoch = args.epoch
    else:
        import litdata

        def make():
            return litdata.StreamingDataset(args.location, shuffle=True, seed=args.seed,
                                            max_cache_size=f"{args.budget_mib}MB")
        epoch = args.epoch + 1  # LitData counts epochs from 1
    print(json.dumps({"baseline_rss_mib": rss_mib()}), flush=True)
    with peak:
        ds = make()
        ds.set_epoch(epoch)
        limit = args.limit or len(ds)
        t0, cpu0 = time.perf_counter(), time.process_time()
        n = 0
        for _ in ds:
            n += 1
            if n >= limit:
                break
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    stats = getattr(ds, "last_stats", None) or {}
    print(json.dumps({"records": n, "seconds": seconds, "cpu_s": cpu_s, "stats": stats,
                      "peak_rss_mib": peak.peak}), flush=True)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def measure(python: str, impl: str, location: str, budget_mib: int, opts: argparse.Namespace,
            block_size: int, servers: dict[str, list[int]]) -> dict:
    """One epoch in a child process: its rate, peak RSS, RSS over time, and the CPU time it and
    each server process (`servers`: name -> pids) spent meanwhile."""
    cmd = [python, os.path.abspath(__file__), "--child", "--impl", impl, "--location", location,
           "--budget-mib", str(budget_mib), "--seed", str(opts.seed), "--epoch", "1",
           "--block-size", str(block_size), "--max-inflight", str(opts.max_inflight),
           "--http-threads", str(opts.http_threads),
           "--group-records", str(opts.group_records), "--coalesce-gap", str(opts.coalesce_gap),
           "--limit", str(opts.limit)]
    # The repo's package first; the rest of PYTHONPATH kept (the GPU machine's carried wheels).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(REPO, "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    server_cpu0 = {name: cpu_seconds(pids) for name, pids in servers.items()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    series: list[tuple[float, float]] = []
    done = threading.Event()
    t0 = time.perf_counter()

    def sample():
        while not done.wait(0.05):
            try:
                series.append((time.perf_counter() - t0, rss_mib(proc.pid)))
            except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
                break

    sampler = threading.Thread(target=sample)
    sampler.start()
    err: list[str] = []
    errors = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    errors.start()
    killer = threading.Timer(opts.timeout, proc.kill)
    killer.start()
    lines: list[tuple[float, str]] = []
    try:
        # Two lines, each timed: the baseline after the imports (importing torch briefly peaks
        # higher than where it settles) and the result after the epoch (the interpreter's
        # teardown then briefly peaks too). Only RSS between them is the loader's doing.
        for line in proc.stdout:
            if line.startswith("{"):
                lines.append((time.perf_counter() - t0, line))
        proc.wait()
    finally:
        killer.cancel()
        done.set()
        sampler.join()
        errors.join()
    if proc.returncode != 0 or len(lines) < 2:
        raise RuntimeError(f"{impl} on {location} failed ({proc.returncode}): "
                           f"{''.join(err).strip()[-2000:]}")
    server_cpu = {name: cpu_seconds(pids) - server_cpu0[name] for name, pids in servers.items()}
    (t_base, first), (t_end, last) = lines[0], lines[-1]
    baseline = json.loads(first)["baseline_rss_mib"]
    result = json.loads(last)
    series = [(t, r) for t, r in series if t_base <= t <= t_end]
    peak = result["peak_rss_mib"]
    return {"records": result["records"], "seconds": result["seconds"],
            "records_per_s": result["records"] / result["seconds"], "peak_rss_mib": peak,
            "baseline_rss_mib": baseline, "rss_over_baseline_mib": peak - baseline,
            "cpu_s": {"loader": result["cpu_s"], **server_cpu},
            "stats": result["stats"], "rss_series": series}


# ---------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def litdata_copy(manifest: dict, data_dir: str, python: str) -> str | None:
    """The same records in LitData's format (optimize()), or None when LitData is not importable."""
    out = os.path.join(data_dir, "litdata")
    script = f"""
import json, os, sys
import litdata
sys.path.insert(0, {os.path.join(REPO, 'python')!r})
from tpfkit import _C
shards = {[os.path.join(data_dir, 'ds', s['path']) for s in manifest['shards']]!r}
def records(path):
    r = _C.StoreReader(path, True)
    for i in range(len(r)):
        yield {{k: (v.copy() if hasattr(v, 'copy') else v) for k, v in r[i].items()}}
if __name__ == '__main__':
    litdata.optimize(fn=records, inputs=shards, output_dir={out!r}, chunk_bytes='64MB', num_workers=1)
"""
    probe = subprocess.run([python, "-c", "import litdata"], capture_output=True)
    if probe.returncode != 0:
        return None
    index = os.path.join(out, "index.json")
    if not os.path.exists(index) or not json.load(open(index)).get("chunks"):
        # optimize() starts worker processes that import the function: it needs a real module file.
        script_path = os.path.join(data_dir, "litdata_convert.py")
        with open(script_path, "w") as f:
            f.write(script)
        subprocess.run([python, script_path], check=True)
    return out


def plot(rows: list[dict], series: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(20, 5.5))
    labels = [f"{r['impl']}\n{r['source']} {r['shuffle']}\n{r['budget_mib']} MiB" for r in rows]
    x = range(len(rows))
    ax1.bar(x, [r["records_per_s"] for r in rows],
            color=["C0" if r["impl"] == "tpfkit" else "C1" for r in rows])
    ax1.set_xticks(x, labels, fontsize=6, rotation=90)
    ax1.set_ylabel("records/s (shuffled epoch, median of repeats)")
    ax1.set_title("throughput")
    bottom = [0.0] * len(rows)
    for i, who in enumerate(("loader", "nginx", "proxy")):
        us = [r["cpu_us_per_record"].get(who, 0.0) for r in rows]
        ax2.bar(x, us, bottom=bottom, label=who, color=f"C{i + 2}")
        bottom = [b + u for b, u in zip(bottom, us)]
    ax2.set_xticks(x, labels, fontsize=6, rotation=90)
    ax2.set_ylabel("CPU microseconds per record")
    ax2.set_title("where the CPU goes (all on the same cores)")
    ax2.legend(fontsize=7)
    for key, s in series.items():
        s = [(t, r) for t, r in s if r > 0]  # a process that has exited reads as 0
        if s:
            t, r = zip(*s)
            ax3.plot(t, r, label=key, linewidth=0.8)
    ax3.set_xlabel("seconds")
    ax3.set_ylabel("RSS (MiB)")
    ax3.set_title("RSS over time")
    ax3.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(runs: list[dict]) -> dict:
    """One row from repeated runs of a configuration: the median rate (and the run it came from
    for CPU and RSS over time), the highest RSS of any run."""
    ranked = sorted(runs, key=lambda r: r["records_per_s"])
    mid = ranked[len(ranked) // 2]
    return {"records_per_s": mid["records_per_s"],
            "records_per_s_runs": [r["records_per_s"] for r in runs],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "baseline_rss_mib": mid["baseline_rss_mib"],
            "rss_over_baseline_mib": max(r["rss_over_baseline_mib"] for r in runs),
            "records": mid["records"], "cpu_s": mid["cpu_s"],
            "cpu_us_per_record": {k: 1e6 * v / mid["records"] for k, v in mid["cpu_s"].items()},
            "stats": mid["stats"], "rss_series": mid["rss_series"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=600_000)
    p.add_argument("--shard-records", type=int, default=50_000)
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 256], help="MiB")
    p.add_argument("--sources", nargs="+", default=["local", "http", "http_5ms"])
    p.add_argument("--shuffles", nargs="+", default=["full", "block64"],
                   help="full: uniform permutation; blockN: blocks of N neighbours shuffled")
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--http-threads", type=int, default=0,
                   help="the loader's HTTP event loops (0: its automatic count, by cores)")
    p.add_argument("--nginx-workers", type=int, default=1,
                   help="nginx worker processes (a server of its own would use all its cores)")
    p.add_argument("--proxy-workers", type=int, default=1,
                   help="processes of the delaying proxy, on one port (SO_REUSEPORT)")
    p.add_argument("--group-records", type=int, default=0,
                   help="plan entries fetched together (the ranges of one shard share a request); "
                        "0: the prefetcher's automatic size")
    p.add_argument("--coalesce-gap", type=int, default=4 << 10,
                   help="bytes between two ranges of a group below which one request covers both")
    p.add_argument("--limit", type=int, default=0, help="records per measurement (0: an epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "tpf-bench-stream"))
    p.add_argument("--peer-python", default=sys.executable,
                   help="python with litdata importable (default: this one)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each configuration (the median rate is reported)")
    p.add_argument("--suffix", default="", help="appended to the result files' names")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--machine", default=os.environ.get("TPF_MACHINE") or platform.node(),
                   help="the machine's name in the rows and the result files' names "
                        "(default: TPF_MACHINE, else the host name)")
    # internal: one measurement
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="tpfkit", help=argparse.SUPPRESS)
    p.add_argument("--location", help=argparse.SUPPRESS)
    p.add_argument("--budget-mib", type=int, help=argparse.SUPPRESS)
    p.add_argument("--epoch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--block-size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--proxy", nargs=3, type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    if args.proxy:
        run_proxy(int(args.proxy[0]), int(args.proxy[1]), args.proxy[2])
        return 0

    import stream_harness as h
    from tpfkit import _C

    manifest = write_dataset(os.path.join(args.data_dir, "ds"), args.records, args.shard_records,
                             args.seed)
    data_mib = manifest["bytes"] / 2**20
    print(f"dataset: {args.records} records, {data_mib:.0f} MiB in {len(manifest['shards'])} shards")
    quality = {}
    for shuffle in args.shuffles:
        block = 0 if shuffle == "full" else int(shuffle.removeprefix("block"))
        quality[shuffle] = shuffle_quality(_C.stream_plan(
            args.records, dict(seed=args.seed, epoch=1, shuffle=True, block_size=block)))
        print(f"shuffle quality {shuffle}: {quality[shuffle]}")

    rows, series, procs = [], {}, []
    machine = f"{args.machine} ({os.cpu_count()} cpus)"
    date = datetime.date.today().isoformat()
    from tpfkit.benchmarks.results import git_commit

    commit = git_commit(REPO)
    work = tempfile.mkdtemp(prefix="tpf-bench-nginx-")
    nginx = h.Nginx(os.path.join(args.data_dir, "ds"), work, workers=args.nginx_workers).__enter__()
    try:
        proxy_port = h.free_port()
        for _ in range(args.proxy_workers):
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--proxy",
                                           str(proxy_port), str(nginx.port), str(args.latency_ms)]))
        wait_port(proxy_port)
        locations = {"local": os.path.join(args.data_dir, "ds", "manifest.json"),
                     "http": f"{nginx.url}/manifest.json",
                     "http_5ms": f"http://127.0.0.1:{proxy_port}/manifest.json"}
        peer_dir = None
        if not args.no_peers:
            peer_dir = litdata_copy(manifest, args.data_dir, args.peer_python)
            if peer_dir is None:
                print("litdata is not importable with --peer-python: peer rows skipped")
        servers = {"nginx": [nginx.proc.pid] + children_of(nginx.proc.pid),
                   "proxy": [proc.pid for proc in procs]}
        configs = [("tpfkit", shuffle, budget, source) for shuffle in args.shuffles
                   for budget in args.budgets for source in args.sources]
        if peer_dir is not None:
            # LitData's own shuffle: chunks shuffled, then records in them.
            configs += [("litdata", "litdata", budget, "local") for budget in args.budgets]
        runs: dict[tuple, list[dict]] = {c: [] for c in configs}
        # Repeats go round all configurations in turn, so a burst of load elsewhere on the
        # machine lands on every configuration alike rather than on one.
        with tqdm(total=len(configs) * args.repeats, desc="measurements") as bar:
            for _ in range(args.repeats):
                for c in configs:
                    impl, shuffle, budget, source = c
                    if impl == "litdata":
                        r = measure(args.peer_python, impl, peer_dir, budget, args, 0, servers)
                    else:
                        block = 0 if shuffle == "full" else int(shuffle.removeprefix("block"))
                        r = measure(sys.executable, impl, locations[source], budget, args, block,
                                    servers)
                    runs[c].append(r)
                    bar.set_postfix_str(f"{source} {shuffle} {budget} MiB: "
                                        f"{r['records_per_s']:.0f} records/s")
                    bar.update(1)
        for c in configs:
            impl, shuffle, budget, source = c
            r = summarize(runs[c])
            row = {"impl": impl, "source": source, "budget_mib": budget, "shuffle": shuffle,
                   "records_per_s": r["records_per_s"], "peak_rss_mib": r["peak_rss_mib"],
                   "baseline_rss_mib": r["baseline_rss_mib"],
                   "rss_over_baseline_mib": r["rss_over_baseline_mib"],
                   "records_per_s_runs": r["records_per_s_runs"], "records": r["records"],
                   "cpu_s": r["cpu_s"], "cpu_us_per_record": r["cpu_us_per_record"],
                   "dataset_mib": data_mib, "commit": commit, "machine": machine, "date": date}
            if impl == "tpfkit":
                st = r["stats"]
                row.update(requests=st.get("requests"),
                           bytes_fetched=st.get("bytes_fetched"),
                           consumer_waits=st.get("consumer_waits"),
                           consumer_wait_s=st.get("consumer_wait_s"),
                           ranges_per_request=st.get("ranges", 0) / max(st.get("requests", 0), 1),
                           request_ms_mean=1e3 * st.get("request_s", 0) / max(st.get("requests", 0), 1),
                           peak_inflight=st.get("peak_inflight"),
                           peak_reserved_mib=r["stats"].get("peak_reserved", 0) / 2**20,
                           shuffle_quality=quality[shuffle])
            rows.append(row)
            series[f"{'ours' if impl == 'tpfkit' else impl} {source} {shuffle} "
                   f"{budget}MiB"] = r["rss_series"]
            print(json.dumps({k: v for k, v in row.items() if k != "shuffle_quality"}))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        nginx.__exit__(None, None, None)

    # The acceptance measure: each remote source's rate as a fraction of local files', per shuffle
    # and budget.
    rate = {(r["shuffle"], r["budget_mib"], r["source"]): r["records_per_s"] for r in rows
            if r["impl"] == "tpfkit"}
    summary = [{"shuffle": sh, "budget_mib": b, "source": src,
                "fraction_of_local": rate[(sh, b, src)] / rate[(sh, b, "local")]}
               for (sh, b, src) in rate if src != "local" and (sh, b, "local") in rate]
    for line in summary:
        print(f"{line['source']} {line['shuffle']} {line['budget_mib']} MiB: "
              f"{100 * line['fraction_of_local']:.0f}% of local")
    os.makedirs(args.out_dir, exist_ok=True)
    name = f"stream-{args.machine}" + (f"-{args.suffix}" if args.suffix else "")
    stem = os.path.join(args.out_dir, name)
    setup = {"nginx": f"Debian's nginx, {args.nginx_workers} worker(s), sendfile and tcp_nopush on "
                      "(tests/python/stream_harness.py)",
             "latency": f"{args.latency_ms} ms added to every request by a splicing proxy "
                        "(bench/stream.py); its CPU is counted apart",
             "nginx_binary": h.nginx_binary(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
             "repeats": args.repeats, "max_inflight": args.max_inflight,
             "http_threads": args.http_threads, "nginx_workers": args.nginx_workers,
             "proxy_workers": args.proxy_workers,
             "group_records": args.group_records, "coalesce_gap": args.coalesce_gap}
    with open(stem + ".json", "w") as f:
        json.dump({"rows": rows, "summary": summary, "setup": setup, "rss_series": series,
                   "shuffle_quality": quality}, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    try:
        plot(rows, series, stem + ".png")
        print(f"wrote {stem}.json and {stem}.png")
    except ImportError as e:  # matplotlib missing: the numbers are in the JSON all the same
        print(f"wrote {stem}.json (no plot: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
