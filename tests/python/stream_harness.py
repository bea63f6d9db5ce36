"""Servers for the streaming tests, all on 127.0.0.1 and started here: Debian's nginx (or the one
TPF_NGINX names) with a config written to a temp dir, moto's S3 server, and a small HTTP server
that injects faults on demand. Every wait is bounded in time; every server is stopped by its context manager."""
from __future__ import annotations

import collections
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from tpfkit.data import RecordWriter
from tpfkit.data.pack import MANIFEST_FORMAT, write_manifest

START_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, what: str,
                  log: str | tuple[str, ...] | None = None) -> None:
    """Waits until `proc` listens on `port`; if it exits first, the error names its logs' text."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            logs = (log,) if isinstance(log, str) else (log or ())
            detail = "".join(open(p).read() for p in logs if os.path.exists(p))
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening: {detail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def nginx_binary() -> str:
    """TPF_NGINX when set (a carried nginx: the GPU machine has none, scripts/build-device-data),
    else the installed one."""
    named = os.environ.get("TPF_NGINX")
    if named:
        if not os.access(named, os.X_OK):
            raise RuntimeError(f"TPF_NGINX={named} is not an executable file")
        return named
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if found is None:
        raise RuntimeError("nginx is not installed (scripts/setup installs Debian's nginx)")
    return found


class Nginx:
    """nginx serving `root` on 127.0.0.1 (range requests are nginx's default for static files), with
    `workers` worker processes (more than one: each with a listening socket of its own, reuseport,
    so the kernel spreads the connections evenly). With access_log, every request is logged, one
    line each, to self.access_log."""

    def __init__(self, root: str, workdir: str, workers: int = 1, access_log: bool = False):
        self.root, self.workdir = os.path.abspath(root), workdir
        self.workers = workers
        self.access_log = os.path.join(workdir, "access.log") if access_log else None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Nginx":
        os.makedirs(self.workdir, exist_ok=True)
        temp = {k: os.path.join(self.workdir, k) for k in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
        for d in temp.values():
            os.makedirs(d, exist_ok=True)
        user = "user root root;\n" if os.geteuid() == 0 else ""
        conf = os.path.join(self.workdir, "nginx.conf")
        self.log = os.path.join(self.workdir, "error.log")
        with open(conf, "w") as f:
            f.write(f"""{user}worker_processes {self.workers};
daemon off;
pid {self.workdir}/nginx.pid;
error_log {self.log} warn;
events {{ worker_connections 1024; }}
http {{
  access_log {self.access_log or "off"};
  sendfile on;
  tcp_nodelay on;
  tcp_nopush on;
  keepalive_requests 1000000;
  keepalive_timeout 60s;
  client_body_temp_path {temp['body']};
  proxy_temp_path {temp['proxy']};
  fastcgi_temp_path {temp['fastcgi']};
  uwsgi_temp_path {temp['uwsgi']};
  scgi_temp_path {temp['scgi']};
  server {{
    listen 127.0.0.1:{self.port}{" reuseport" if self.workers > 1 else ""};
    root {self.root};
  }}
}}
""")
        # Its stderr is kept: a binary that cannot start (a carried one whose libraries do not load)
        # says why there, before any error_log is open.
        stderr = os.path.join(self.workdir, "stderr.log")
        with open(stderr, "w") as err:
            self.proc = subprocess.Popen([nginx_binary(), "-p", self.workdir, "-c", conf],
                                         stdout=subprocess.DEVNULL, stderr=err)
        wait_for_port(self.port, self.proc, "nginx", (self.log, stderr))
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)


class MotoS3:
    """moto's S3 server on 127.0.0.1, with `upload(dir, bucket, prefix)` through boto3."""

    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint}

    def __enter__(self) -> "MotoS3":
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, self.proc, "moto S3 server")
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)

    def upload(self, directory: str, bucket: str, prefix: str) -> None:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.create_bucket(Bucket=bucket)
        for name in sorted(os.listdir(directory)):
            s3.upload_file(os.path.join(directory, name), bucket, f"{prefix}/{name}")


MULTIPART_FAULTS = ("part_elsewhere", "part_no_range", "part_header_flood")
# The faults of a soak (random_faults): errors, resets, bodies cut short, one byte flipped in
# transit, and a 200 with the whole file for a range request.
SOAK_FAULTS = ("503", "reset", "truncate", "corrupt", "full")


class _Server(ThreadingHTTPServer):
    # The default backlog of 5 drops the SYNs of a client that opens 16 connections at once, and
    # each dropped one waits a second for its retransmission.
    request_queue_size = 256
    daemon_threads = True


class FaultServer:
    """A threaded HTTP/1.1 server of the files in `root` with range requests, that answers the next
    requests for a path with scripted faults: fault(path, action, ...) queues actions, each used once.

    Actions: ("status", code[, retry_after]) an error response; ("reset",) a TCP reset before any
    response; ("truncate",) a 206 whose body stops halfway; ("slow", seconds) a response that starts
    only after `seconds`; ("corrupt",) a 206 with one byte flipped; ("full",) a 200 with the whole
    file (ignoring the range). Broken multipart/byteranges answers, used only by
    multi-range requests: ("part_elsewhere",) every part one byte later than asked; ("part_no_range",)
    parts without Content-Range; ("part_header_flood",) 10 KB of part header with no blank line.
    Several ranges in one request get a multipart/byteranges answer, as from nginx, unless
    single_range_only is set.

    Besides the scripted faults: random_faults(rate, seed, kinds) gives each range GET a fault
    with probability `rate`, drawn from a seeded generator, the kinds (SOAK_FAULTS names) in turn;
    corrupt_byte(path, offset, times) flips the byte at file offset `offset` in the next `times`
    GET answers that carry it, whatever their kind (one range, several, the whole file)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.lock = threading.Lock()
        self.faults: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.requests: collections.Counter = collections.Counter()
        self.bytes_served: collections.Counter = collections.Counter()  # body bytes, per path
        self.served_faults: collections.Counter = collections.Counter()
        self.always: dict[str, tuple] = {}
        self.single_range_only = False  # True: answer multi-range requests with the whole file
        self.random: tuple | None = None  # (rate, generator, kinds, multi_only)
        self.corrupt_at: dict[str, dict[int, int]] = collections.defaultdict(dict)
        self.multi_requests = 0
        self.refuse_multi_every = 0  # N > 0: every N-th multi-range request gets the whole file

    def random_faults(self, rate: float, seed: int, kinds: tuple[str, ...] = SOAK_FAULTS,
                      multi_only: bool = False) -> None:
        with self.lock:
            self.random = (rate, np.random.default_rng(seed), kinds, multi_only)

    def corrupt_byte(self, path: str, offset: int, times: int) -> None:
        with self.lock:
            self.corrupt_at[path][offset] = times

    def _flips(self, path: str, spans: list[tuple[int, int, int]]) -> list[int]:
        """Body positions to flip: spans are (file lo, file hi inclusive, body position of lo)."""
        flips = []
        with self.lock:
            for offset, times in self.corrupt_at[path].items():
                if times <= 0:
                    continue
                for lo, hi, at in spans:
                    if lo <= offset <= hi:
                        flips.append(at + offset - lo)
                        self.corrupt_at[path][offset] = times - 1
                        self.served_faults["corrupt_byte"] += 1
                        break
        return flips

    def fault(self, path: str, *actions: tuple) -> None:
        with self.lock:
            self.faults[path].extend(actions)

    def fail_always(self, path: str, action: tuple) -> None:
        with self.lock:
            self.always[path] = action

    def _next_action(self, path: str, is_range: bool, multi: bool = False,
                     head: bool = False) -> tuple | None:
        with self.lock:
            self.requests[path] += 1
            self.multi_requests += multi
            if multi and self.refuse_multi_every and self.multi_requests % self.refuse_multi_every == 0:
                self.served_faults["refuse_multi"] += 1
                return ("full",)
            if self.random is not None and is_range and not head and (multi or not self.random[3]):
                rate, rng, kinds, _ = self.random
                if rng.random() < rate:
                    # Kinds in turn, so a short run still meets each of them.
                    kind = kinds[sum(self.served_faults[k] for k in kinds) % len(kinds)]
                    self.served_faults[kind] += 1
                    return {"503": ("status", 503, 0)}.get(kind, (kind,))
                return None
            if path in self.always:
                action = self.always[path]
            elif is_range and self.faults[path]:
                if self.faults[path][0][0] in MULTIPART_FAULTS and not multi:
                    return None  # kept for the next multi-range request
                action = self.faults[path].popleft()
            else:
                return None
            self.served_faults[action[0]] += 1
            return action

    def __enter__(self) -> "FaultServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.respond(head=True)

            def do_GET(self) -> None:
                self.respond(head=False)

            def respond(self, head: bool) -> None:
                path = self.path.split("?")[0]
                file = os.path.join(server.root, path.lstrip("/"))
                rng = self.headers.get("Range")
                action = server._next_action(path, rng is not None or head,
                                             multi=rng is not None and "," in rng, head=head)
                if action and action[0] == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if action and action[0] == "slow":
                    time.sleep(action[1])
                if action and action[0] == "status":
                    body = f"injected {action[1]}".encode()
                    self.send_response(action[1])
                    if len(action) > 2:
                        self.send_header("Retry-After", str(action[2]))
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if not head:
                        self.wfile.write(body)
                    return
                if not os.path.isfile(file):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = open(file, "rb").read()
                if head:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return
                spans = [tuple(int(x) for x in part.split("-"))
                         for part in rng.removeprefix("bytes=").split(",")] if rng else []
                if (rng is None or (action and action[0] == "full")
                        or (len(spans) > 1 and server.single_range_only)):
                    body = bytearray(data)
                    for at in server._flips(path, [(0, len(data) - 1, 0)]):
                        body[at] ^= 0xFF
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.send(body, path)
                    return
                if len(spans) > 1:
                    boundary = "tpfboundary"
                    body = bytearray()
                    flip = None  # a byte inside the first part's data
                    parts = []  # (file lo, file hi, body position of lo)
                    kind = action[0] if action else None
                    for lo, hi in spans:
                        if kind == "part_elsewhere":
                            lo, hi = lo + 1, min(hi + 1, len(data) - 1)
                        body += f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n".encode()
                        if kind == "part_header_flood":
                            body += b"X-Filler: " + b"x" * 10240
                        elif kind != "part_no_range":
                            body += f"Content-Range: bytes {lo}-{hi}/{len(data)}\r\n".encode()
                        body += b"\r\n"
                        flip = len(body) + (hi - lo) // 2 if flip is None else flip
                        parts.append((lo, hi, len(body)))
                        body += data[lo:hi + 1]
                    body += f"\r\n--{boundary}--\r\n".encode()
                    content_type = f"multipart/byteranges; boundary={boundary}"
                    content_range = None
                else:
                    lo, hi = spans[0]
                    body = bytearray(data[lo:hi + 1])
                    flip = len(body) // 2
                    parts = [(lo, hi, 0)]
                    content_type = "application/octet-stream"
                    content_range = f"bytes {lo}-{hi}/{len(data)}"
                if action and action[0] == "corrupt":
                    body[flip] ^= 0xFF
                for at in server._flips(path, parts):
                    body[at] ^= 0xFF
                self.send_response(206)
                self.send_header("Content-Type", content_type)
                if content_range:
                    self.send_header("Content-Range", content_range)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if action and action[0] == "truncate":
                    try:
                        self.wfile.write(body[: len(body) // 2])
                        self.wfile.flush()
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    self.close_connection = True
                    return
                self.send(body, path)

            def send(self, body, path: str) -> None:
                with server.lock:
                    server.bytes_served[path] += len(body)
                # A client may stop reading early (it had the bytes it asked for from a whole file).
                try:
                    self.wfile.write(body)
                except OSError:
                    self.close_connection = True

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        # Clients that stop reading (a whole file read only as far as needed, a cancelled stream)
        # reset their connections: expected here, not worth a traceback.
        self.httpd.handle_error = lambda request, address: None
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def write_dataset(directory: str, rng: np.random.Generator, shards: int, records_per_shard: int,
                  max_atoms: int = 40, codecs: tuple[str, ...] = ("none", "zstd", "lz4")) -> list[dict]:
    """Shards of random records (an int64 `id` = global record number, `numbers`, `positions`) and a
    manifest.json beside them. Returns each record's arrays, by id (the reference)."""
    os.makedirs(directory, exist_ok=True)
    reference, entries = [], []
    for s in range(shards):
        name = f"shard-{s:05d}.tpf"
        path = os.path.join(directory, name)
        with RecordWriter(path, compression=codecs[s % len(codecs)], overwrite=True) as w:
            for _ in range(records_per_shard):
                n = int(rng.integers(1, max_atoms + 1))
                rec = {"id": np.int64(len(reference)),
                       "numbers": rng.integers(1, 90, size=n).astype(np.int32),
                       "positions": rng.standard_normal((n, 3)).astype(np.float32)}
                w.append(rec)
                reference.append(rec)
        entries.append({"path": name, "records": records_per_shard, "bytes": os.path.getsize(path)})
    write_manifest({"format": MANIFEST_FORMAT, "shards": entries},
                   os.path.join(directory, "manifest.json"))
    return reference
