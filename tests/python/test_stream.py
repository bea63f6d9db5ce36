"""FoldPipe end to end: nginx and moto's S3 on 127.0.0.1, a fault-injecting server, DataLoader
workers, ranks, resume, and the memory budget. Each test builds fresh seeded random shards; the
reference is the records as written."""
from __future__ import annotations

import itertools
import json
import os
import threading
import time

import numpy as np
import pytest
import torch

import stream_harness as h
from tpfkit import _C
from tpfkit.data import StreamingDataset
from tpfkit.data.pack import MANIFEST_FORMAT, write_manifest


@pytest.fixture
def dataset(tmp_path, seed):
    """Three shards (none, zstd, lz4) of random records, and their reference."""
    rng = np.random.default_rng(seed)
    directory = str(tmp_path / "ds")
    reference = h.write_dataset(directory, rng, shards=3, records_per_shard=int(rng.integers(90, 140)))
    return directory, reference


@pytest.fixture
def nginx(tmp_path, dataset):
    with h.Nginx(dataset[0], str(tmp_path / "nginx")) as server:
        yield server


def check_record(record: dict, reference: list[dict]) -> int:
    i = int(record["id"])
    for key in ("numbers", "positions"):
        np.testing.assert_array_equal(record[key], reference[i][key], err_msg=f"record {i} {key}")
    return i


def as_list(batch):
    return batch


def collect(ds, reference, num_workers=0, batch_size=1):
    """Record ids in the order a DataLoader hands them over, each checked against the reference."""
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=num_workers,
                                         collate_fn=as_list)
    ids = []
    for batch in loader:
        for record in batch:
            ids.append(check_record(record, reference))
    return ids


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_record_once_per_epoch_across_ranks_and_workers(nginx, dataset, drop_last, seed):
    _, reference = dataset
    n, world = len(reference), 3
    seen = []
    per_rank = set()
    for rank in range(world):
        ds = StreamingDataset(nginx.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              rank=rank, world_size=world, drop_last=drop_last, batch_size=4)
        ids = collect(ds, reference, num_workers=2, batch_size=4)
        assert len(ids) == len(ds)
        per_rank.add(len(ids))
        seen += ids
    assert len(per_rank) == 1, f"ranks got different counts {per_rank}"
    counts = np.bincount(seen, minlength=n)
    if drop_last:
        assert len(seen) == n // world * world
        assert counts.max() == 1, "a record came twice"
    else:
        assert len(seen) == -(-n // world) * world
        assert counts.min() == 1, "a record was skipped"
        assert counts.sum() - n == len(seen) - n


def test_same_order_for_same_seed_and_epoch(nginx, dataset, seed):
    directory, reference = dataset
    url = nginx.url + "/manifest.json"
    a = collect(StreamingDataset(url, cache_bytes=1 << 20, seed=seed), reference)
    b = collect(StreamingDataset(directory + "/manifest.json", cache_bytes=1 << 20, seed=seed),
                reference)
    assert a == b, "the same seed and epoch must give the same order over HTTP and from files"
    assert sorted(a) == list(range(len(reference)))
    later = StreamingDataset(url, cache_bytes=1 << 20, seed=seed)
    later.set_epoch(1)
    assert collect(later, reference) != a
    other = StreamingDataset(url, cache_bytes=1 << 20, seed=seed + 1)
    assert collect(other, reference) != a
    blocked = StreamingDataset(url, cache_bytes=1 << 20, seed=seed, block_size=16)
    ids = collect(blocked, reference)
    assert sorted(ids) == list(range(len(reference)))
    assert ids == collect(StreamingDataset(url, cache_bytes=1 << 20, seed=seed, block_size=16), reference)


@pytest.mark.parametrize("workers_before,workers_after", [(2, 1), (0, 2), (1, 2)])
def test_resume_mid_epoch_gives_exactly_the_remaining_records(nginx, dataset, seed,
                                                               workers_before, workers_after):
    _, reference = dataset
    url, batch, world = nginx.url + "/manifest.json", 4, 2
    rng = np.random.default_rng(seed)
    epoch = int(rng.integers(0, 5))
    full, stopped, resumed = [], [], []
    for rank in range(world):
        ds = StreamingDataset(url, cache_bytes=512 << 10, seed=seed, rank=rank, world_size=world,
                              batch_size=batch, drop_last=True)
        ds.set_epoch(epoch)
        full.append(collect(ds, reference, num_workers=workers_before, batch_size=batch))
    per_rank = len(full[0])
    k_batches = int(rng.integers(1, per_rank // batch))
    states = []
    for rank in range(world):
        ds = StreamingDataset(url, cache_bytes=512 << 10, seed=seed, rank=rank, world_size=world,
                              batch_size=batch, drop_last=True)
        ds.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers_before,
                                             collate_fn=as_list)
        taken = []
        for batch_records in loader:
            taken += [check_record(r, reference) for r in batch_records]
            if len(taken) == k_batches * batch:
                break
        del loader
        stopped.append(taken)
        states.append(ds.state_dict(num_consumed=len(taken)))
    for rank in range(world):
        ds = StreamingDataset(url, cache_bytes=512 << 10, seed=seed, rank=rank, world_size=world,
                              batch_size=batch, drop_last=True)
        ds.load_state_dict(states[rank])
        ds.set_epoch(epoch)
        resumed.append(collect(ds, reference, num_workers=workers_after, batch_size=batch))
    for rank in range(world):
        assert stopped[rank] + resumed[rank] == full[rank], f"rank {rank} resumed wrongly"
    # The state is the same on every rank, so any rank count can resume from it.
    assert states[0] == states[1]
    one = StreamingDataset(url, cache_bytes=512 << 10, seed=seed, rank=0, world_size=1, drop_last=True)
    one.load_state_dict(states[0])
    rest = collect(one, reference)
    done = set(stopped[0]) | set(stopped[1])
    assert sorted(rest + sorted(done)) == list(range(len(reference)))


def test_workers_forked_while_the_parent_streams(nginx, dataset, seed):
    """DataLoader workers fork while the parent has HTTP reads in flight: each worker opens its own
    connections and event loop, and the parent's stream goes on untouched."""
    _, reference = dataset
    ds = StreamingDataset(nginx.url + "/manifest.json", cache_bytes=64 << 10, seed=seed)
    it = iter(ds)
    first = [check_record(next(it), reference) for _ in range(5)]
    assert sorted(collect(ds, reference, num_workers=2)) == list(range(len(reference)))
    rest = [check_record(r, reference) for r in it]
    assert sorted(first + rest) == list(range(len(reference)))


def test_stopping_with_requests_in_flight_or_backing_off_is_prompt(tmp_path, dataset, seed):
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        # Requests time out after 1 s, then wait at least 5 s before their retry.
        slow_retry = dict(request_timeout_s=1.0, backoff_base_s=5.0, backoff_max_s=10.0,
                          max_attempts=3, retry_deadline_s=60.0)
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=1 << 20, seed=seed,
                              shuffle=False, group_records=4, **slow_retry)
        assert collect(ds, reference) == list(range(len(reference)))
        # In order, in small groups: shard 0's records come first while shard 1's requests hang.
        server.fail_always("/shard-00001.tpf", ("slow", 30.0))
        for wait_s in (0.0, 1.5):  # stop with requests in flight, then with them backing off
            ds.set_epoch(1)
            it = iter(ds)
            assert [check_record(next(it), reference) for _ in range(5)] == list(range(5))
            time.sleep(wait_s)
            t0 = time.monotonic()
            it.close()
            assert time.monotonic() - t0 < 2, f"stopping waited for abandoned requests ({wait_s} s)"


def test_resume_state_is_checked(dataset, seed):
    directory, _ = dataset
    ds = StreamingDataset(directory + "/manifest.json", seed=seed)
    state = ds.state_dict(num_consumed=3)
    other = StreamingDataset(directory + "/manifest.json", seed=seed + 1)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        ds.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="rank"):
        StreamingDataset(directory + "/manifest.json", rank=2, world_size=2)
    with pytest.raises(ValueError, match="cache_bytes"):
        StreamingDataset(directory + "/manifest.json", cache_bytes=0)
    with pytest.raises(ValueError, match="source"):
        StreamingDataset(42)


def test_manifests_written_before_the_rename_are_read(dataset):
    """`format` is "tpfkit-manifest"; manifests packed before the package was renamed carry
    "turbopairformer-manifest" and are still read; any other format is refused."""
    directory, reference = dataset
    path = os.path.join(directory, "manifest.json")
    manifest = json.load(open(path))
    assert manifest["format"] == MANIFEST_FORMAT == "tpfkit-manifest"
    manifest["format"] = "turbopairformer-manifest"
    write_manifest(manifest, path)
    assert collect(StreamingDataset(path, shuffle=False), reference) == list(range(len(reference)))
    manifest["format"] = "other-manifest"
    write_manifest(manifest, path)
    with pytest.raises(ValueError, match='format = "tpfkit-manifest"'):
        StreamingDataset(path)

def test_s3_through_moto(tmp_path, dataset, seed, monkeypatch):
    directory, reference = dataset
    with h.MotoS3() as s3:
        s3.upload(directory, "shards", "train/v1")
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        ds = StreamingDataset("s3://shards/train/v1/manifest.json", cache_bytes=512 << 10, seed=seed)
        ids = collect(ds, reference, num_workers=2)
        assert sorted(ids) == list(range(len(reference)))
        missing = "s3://shards/train/v1/missing.tpf"
        with pytest.raises(RuntimeError, match="missing.tpf"):
            StreamingDataset([missing])
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(ValueError, match="AWS_SECRET_ACCESS_KEY"):
            StreamingDataset("s3://shards/train/v1/shard-00000.tpf")


FAST_RETRY = dict(backoff_base_s=0.01, backoff_max_s=0.05, max_attempts=5, request_timeout_s=2.0,
                  connect_timeout_s=2.0, retry_deadline_s=20.0)


@pytest.mark.parametrize("action", [("status", 500), ("status", 503, 0), ("status", 429, 0),
                                    ("status", 502), ("reset",), ("truncate",), ("slow", 3.0),
                                    ("corrupt",)])
def test_faults_are_survived(tmp_path, dataset, seed, action):
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        # Faults on the first range requests of the second shard: its index reads and its records.
        server.fault("/shard-00001.tpf", *([action] * 3))
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              **FAST_RETRY)
        ids = collect(ds, reference)
        assert sorted(ids) == list(range(len(reference))), "a record was lost or duplicated"
        assert server.served_faults[action[0]] == 3
        if action[0] == "corrupt":
            # Corrupt index reads fail the index checksum; corrupt record reads are fetched again.
            assert ds.last_stats is not None


def http_loop_threads() -> int:
    """This process's HTTP event loops (threads named tpf-http)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass
    return names.count("tpf-http")


@pytest.mark.parametrize("max_connections,action", [(16, ("status", 503, 0)), (16, ("reset",)),
                                                    (2, ("truncate",)), (16, ("corrupt",)),
                                                    (5, ("part_elsewhere",))])
def test_requests_spread_over_several_event_loops(tmp_path, dataset, seed, max_connections, action):
    """A source's requests go to three event loops in turn (two when it has two connections), faults
    and all: every record comes once and right, workers included."""
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        server.fault("/shard-00001.tpf", *([action] * 3))
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              http_threads=3, max_connections=max_connections, coalesce_gap=0,
                              group_records=16, **FAST_RETRY)
        ids = collect(ds, reference)
        assert sorted(ids) == list(range(len(reference))), "a record was lost or duplicated"
        assert server.served_faults[action[0]] == 3
        assert http_loop_threads() >= min(3, max_connections)
        ds.set_epoch(1)
        assert sorted(collect(ds, reference, num_workers=2)) == list(range(len(reference)))
        with pytest.raises(ValueError, match="http_threads"):
            StreamingDataset(server.url + "/manifest.json", http_threads=-1)


@pytest.mark.parametrize("action", [(a,) for a in h.MULTIPART_FAULTS])
def test_broken_multipart_answers_are_retried(tmp_path, dataset, seed, action):
    """A server whose multipart/byteranges answers put parts elsewhere, leave out their
    Content-Range or flood their headers: the request is retried, no record is lost or wrong."""
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        server.fault("/shard-00001.tpf", *([action] * 3))
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              coalesce_gap=0, **FAST_RETRY)
        ids = collect(ds, reference)
        assert sorted(ids) == list(range(len(reference))), "a record was lost or duplicated"
        assert server.served_faults[action[0]] == 3, "the faults never met a multi-range request"


def test_corrupt_records_are_fetched_again(tmp_path, dataset, seed):
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              group_records=1, coalesce_gap=0, **FAST_RETRY)
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        assert ds.last_stats["refetches"] == 0
        # The shards are open now: the faults hit record reads of the next epoch.
        server.fault("/shard-00002.tpf", ("corrupt",), ("corrupt",))
        ds.set_epoch(1)
        ids = collect(ds, reference)
        assert sorted(ids) == list(range(len(reference)))
        assert ds.last_stats["refetches"] == 2


def test_servers_without_multi_range_requests(tmp_path, dataset, seed):
    """A server that answers every multi-range request with the whole file, which is too long to
    read that far: the ranges go one per request for spells between probes, no record is lost."""
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        server.single_range_only = True
        # A small budget, so groups are planned while the first answers come back.
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=32 << 10, seed=seed,
                              coalesce_gap=0, group_records=8, full_body_max_bytes=1024,
                              **FAST_RETRY)
        ids = collect(ds, reference)
        assert sorted(ids) == list(range(len(reference)))
        stats = ds.last_stats
        assert stats["single_range_spells"] >= 3, stats  # one per shard at least
        assert stats["multi_range_probes"] >= 1, stats
        assert stats["multi_range_refused"] < server.multi_requests + 1
        # Each refused request costs one more per range; a spell's requests carry one range each.
        assert sum(server.requests.values()) >= len(reference) // 2


def test_one_refused_multi_range_request_now_and_then_costs_nothing(tmp_path, dataset, seed):
    """Every 7th multi-range request answered with 200 and the whole file (as a cache or proxy
    may): its bytes are taken from that body and the shard keeps asking for many ranges at once
    (once, one such answer switched it to one range per request for good)."""
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        # One request in flight at a time: answers then end in the order the requests started,
        # so every 7th refused is never three refusals in a row (with requests in flight
        # together, their completions could meet in a row by chance and rightly start a spell).
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              coalesce_gap=0, group_records=16, max_connections=1, max_inflight=1,
                              **FAST_RETRY)
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        before = sum(server.requests.values())
        assert collect(ds, reference) == collect(ds, reference)  # the same epoch, fault-free
        fault_free = (sum(server.requests.values()) - before) // 2
        server.refuse_multi_every = 7
        before = sum(server.requests.values())
        ids = collect(ds, reference)
        assert sorted(ids) == list(range(len(reference)))
        assert server.served_faults["refuse_multi"] >= 3
        stats = ds.last_stats
        assert stats["full_body_answers"] == server.served_faults["refuse_multi"], stats
        assert stats["single_range_spells"] == 0, stats
        assert sum(server.requests.values()) - before == fault_free


def test_200_answers_to_range_requests_are_read_from_the_whole_body(tmp_path, dataset, seed):
    """A server that answers every range request of a shard with 200 and the whole file: the
    records are taken from it; where they lie past full_body_max_bytes the request is asked again,
    and the error that ends the retries says why without quoting the body."""
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        server.fail_always("/shard-00001.tpf", ("full",))
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              **FAST_RETRY)
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        assert ds.last_stats["full_body_answers"] > 0
        with pytest.raises(RuntimeError, match="shard-00001.tpf.*full_body_max_bytes") as e:
            StreamingDataset(server.url + "/manifest.json", full_body_max_bytes=64, **FAST_RETRY)
        message = str(e.value)
        assert "TPFSTORE" not in message and message.isprintable(), message
        assert server.requests["/shard-00001.tpf"] >= FAST_RETRY["max_attempts"]


def record_offset(directory: str, reference: list[dict], i: int) -> tuple[str, int]:
    """(URL path, file offset) of bytes inside record i's positions (shard 0, uncompressed)."""
    data = open(os.path.join(directory, "shard-00000.tpf"), "rb").read()
    at = data.find(reference[i]["positions"].tobytes())
    assert at > 0 and data.find(reference[i]["positions"].tobytes(), at + 1) < 0
    return "/shard-00000.tpf", at


def test_a_record_damaged_in_transit_several_times_in_a_row_comes_right(tmp_path, dataset, seed):
    directory, reference = dataset
    rng = np.random.default_rng(seed)
    with h.FaultServer(directory) as server:
        # No gap bytes: the byte then travels only in its own record's requests.
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              coalesce_gap=0, verify_backoff_base_s=0.005,
                              verify_backoff_max_s=0.02, **FAST_RETRY)
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        path, at = record_offset(directory, reference, int(rng.integers(0, 90)))
        # Five bad copies in a row (once, three ended the epoch).
        server.corrupt_byte(path, at, 5)
        ds.set_epoch(1)
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        assert server.served_faults["corrupt_byte"] == 5
        assert ds.last_stats["refetches"] == 5, ds.last_stats
        # Corrupt at the source: every copy is bad, and the error says what was checked.
        server.corrupt_byte(path, at, 1000)
        ds.set_epoch(2)
        with pytest.raises(RuntimeError, match=r"shard-00000.tpf.*did not match the XXH3-64 "
                                               r"checksum in the shard's index on each of 8 fetches"):
            collect(ds, reference)


def test_the_manifest_is_read_again_when_damaged_and_checked_against_its_sha256(tmp_path, dataset):
    directory, reference = dataset
    manifest = os.path.join(directory, "manifest.json")
    with h.FaultServer(directory) as server:
        # A flipped byte in transit: the first download fails its checks, the second is right.
        server.corrupt_byte("/manifest.json", os.path.getsize(manifest) // 2, 1)
        ds = StreamingDataset(server.url + "/manifest.json", shuffle=False, **FAST_RETRY)
        assert ds.manifests[0]["verified"] and ds.manifests[0]["downloads"] == 2
        assert collect(ds, reference) == list(range(len(reference)))
        # A manifest changed after tpf pack wrote it (its records count, here) never matches.
        text = open(manifest).read()
        edited = text.replace('"records": ', '"records": 1', 1)
        open(manifest, "w").write(edited)
        with pytest.raises(ValueError, match=r"manifest .*manifest.json' does not match its "
                                             r"manifest_sha256 .* on each of 5 downloads"):
            StreamingDataset(server.url + "/manifest.json", **FAST_RETRY)
        with pytest.raises(ValueError, match="does not match its manifest_sha256"):
            StreamingDataset(manifest)
        # Version 2 manifests must carry it.
        open(manifest, "w").write(text.replace('"manifest_sha256"', '"other"'))
        with pytest.raises(ValueError, match="has no manifest_sha256"):
            StreamingDataset(manifest)


def test_retries_show_in_last_stats_and_tpf_stream(tmp_path, dataset, seed, capsys):
    from tpfkit import cli

    directory, reference = dataset
    with h.FaultServer(directory) as server:
        ds = StreamingDataset(server.url + "/manifest.json", seed=seed, **FAST_RETRY)
        server.fault("/shard-00002.tpf", ("status", 503, 0), ("status", 500))
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        assert ds.last_stats["retries"] == 2, ds.last_stats
        server.fault("/shard-00002.tpf", ("status", 503, 0), ("full",))
        assert cli.main(["stream", server.url + "/manifest.json", "--quiet"]) == 0
        out = capsys.readouterr().out
        assert "retries 1" in out and "200-for-206 answers read 1" in out, out


def test_soak_one_epoch_at_5_percent_mixed_faults(tmp_path, seed):
    """One epoch through a server that gives 5% of range requests a fault (503, reset, a body cut
    short, a byte flipped in transit, 200 with the whole file): every record once, each checked
    against what was written. (bench/stream_faults.py measures its speed against no faults.)"""
    rng = np.random.default_rng(seed)
    directory = str(tmp_path / "soak")
    reference = h.write_dataset(directory, rng, shards=4, records_per_shard=500, max_atoms=60)
    with h.FaultServer(directory) as server:
        server.random_faults(0.05, seed)
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=1 << 20, seed=seed,
                              group_records=16, verify_backoff_base_s=0.01,
                              verify_backoff_max_s=0.1, **FAST_RETRY)
        ids = collect(ds, reference)
    assert sorted(ids) == list(range(len(reference))), "a record was lost or came twice"
    for kind in h.SOAK_FAULTS:
        assert server.served_faults[kind] > 0, (kind, dict(server.served_faults))
    assert ds.last_stats["retries"] + ds.last_stats["refetches"] > 0


def test_disk_cache_serves_later_epochs(tmp_path, dataset, seed):
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        # No coalescing gap: the requests then cover records only, all of which the first epoch
        # stores (with gaps, a later epoch fetches the gap bytes it never saw).
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=256 << 10, seed=seed,
                              coalesce_gap=0, disk_cache_dir=str(tmp_path / "cache"),
                              disk_cache_bytes=64 << 20)
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        first = sum(server.requests.values())
        ds.set_epoch(1)
        assert sorted(collect(ds, reference)) == list(range(len(reference)))
        assert sum(server.requests.values()) == first, "the second epoch should read the disk only"
        stats = ds.disk_cache_stats
        assert stats["hit_bytes"] > 0 and stats["used_bytes"] <= stats["budget"]
    with pytest.raises(ValueError, match="disk_cache_bytes"):
        StreamingDataset(directory + "/manifest.json", disk_cache_dir=str(tmp_path / "c2"))


def test_unreachable_shards_raise_their_url_within_bounded_time(tmp_path, dataset):
    directory, _ = dataset
    dead = f"http://127.0.0.1:{h.free_port()}/shard-00000.tpf"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=dead.replace(".", r"\.")):
        StreamingDataset([dead], **FAST_RETRY)
    assert time.monotonic() - t0 < 15
    with h.FaultServer(directory) as server:
        with pytest.raises(RuntimeError, match="missing.tpf.*404"):
            StreamingDataset([server.url + "/missing.tpf"], **FAST_RETRY)
        assert server.requests["/missing.tpf"] == 1, "a 404 is not retried"
        server.fail_always("/shard-00001.tpf", ("status", 503))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="shard-00001.tpf.*503"):
            list(StreamingDataset(server.url + "/manifest.json", **FAST_RETRY))
        assert server.requests["/shard-00001.tpf"] == FAST_RETRY["max_attempts"]
        assert time.monotonic() - t0 < 15
        server.fail_always("/shard-00001.tpf", ("status", 403))
        with pytest.raises(RuntimeError, match="shard-00001.tpf.*403 .expected 206"):
            StreamingDataset(server.url + "/manifest.json", **FAST_RETRY)


def test_a_shard_failing_mid_epoch_raises_its_url(tmp_path, dataset, seed):
    directory, reference = dataset
    with h.FaultServer(directory) as server:
        # A budget of a few pages: shard 2 cannot be prefetched before the fault is set.
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=16 << 10, seed=seed,
                              shuffle=False, group_records=4, **FAST_RETRY)
        it = iter(ds)
        first = check_record(next(it), reference)
        assert first == 0
        server.fail_always("/shard-00002.tpf", ("reset",))
        with pytest.raises(RuntimeError, match="shard-00002.tpf"):
            for record in it:
                check_record(record, reference)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("http_threads", [0, 4])
def test_memory_stays_under_the_budget_under_load(tmp_path, seed, http_threads):
    rng = np.random.default_rng(seed)
    directory = str(tmp_path / "big")
    # ~24 MiB of records of up to ~24 KiB each, streamed through a 2 MiB budget.
    reference = h.write_dataset(directory, rng, shards=4, records_per_shard=400, max_atoms=1000,
                                codecs=("none",))
    budget = 2 << 20
    with h.Nginx(directory, str(tmp_path / "nginx")) as server:
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=budget, seed=seed,
                              max_inflight=16, http_threads=http_threads)
        baseline = rss_bytes()
        peak = [baseline]
        done = threading.Event()

        def sample():
            while not done.wait(0.002):
                peak[0] = max(peak[0], rss_bytes())

        sampler = threading.Thread(target=sample)
        sampler.start()
        count = 0
        try:
            for record in ds:
                check_record(record, reference)
                count += 1
        finally:
            done.set()
            sampler.join()
    assert count == len(reference)
    assert ds.last_stats["peak_reserved"] <= budget
    assert ds.last_stats["peak_reserved"] > budget // 2, "the prefetcher should fill its budget"
    # What the loader adds beyond its budget: threads' stacks, curl handles, the plan, one record.
    fixed_overhead = 32 << 20
    assert peak[0] - baseline <= budget + fixed_overhead, (
        f"RSS grew by {(peak[0] - baseline) / 2**20:.1f} MiB with a {budget / 2**20:.0f} MiB budget")


def test_tpf_stream_cli(dataset, capsys):
    from tpfkit import cli

    directory, reference = dataset
    assert cli.main(["stream", directory + "/manifest.json", "--cache-mib", "1", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{2 * len(reference)} records" in out
    assert "records/s" in out
    assert cli.main(["stream", directory + "/nothing.json"]) == 2


def test_plan_binding_matches_the_documented_split(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 500))
    plan = dict(seed=seed, epoch=3, shuffle=True, block_size=0, drop_last=True)
    order = _C.stream_plan(n, plan)
    assert sorted(order.tolist()) == list(range(n))
    ranks = [_C.stream_plan(n, {**plan, "rank": r, "world_size": 4}) for r in range(4)]
    assert np.array_equal(np.stack(ranks, axis=1).reshape(-1), order[: n // 4 * 4])
    # Workers take whole batches of their rank's list in turn.
    workers = [_C.stream_plan(n, {**plan, "rank": 1, "world_size": 4, "worker": w,
                                  "num_workers": 2, "batch_size": 3}) for w in range(2)]
    batches = [np.array_split(w, np.arange(3, len(w), 3)) for w in workers]
    merged = [b for pair in itertools.zip_longest(*batches) for b in pair if b is not None]
    assert np.array_equal(np.concatenate(merged), ranks[1])
    with pytest.raises(ValueError, match="rank: expected < world_size"):
        _C.stream_plan(n, {"rank": 4, "world_size": 4})
    with pytest.raises(ValueError, match="unknown option 'max_inflights'"):
        StreamingDataset(["x.tpf"], max_inflights=3)


def test_streams_what_tpf_pack_writes(tmp_path, seed):
    """`tpf pack` output (extxyz through ASE) served by nginx, against the local RecordReader."""
    import ase
    import ase.io

    from tpfkit.data import RecordReader
    from tpfkit.data.pack import pack

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 20, size=int(rng.integers(40, 80)))
    frames = [ase.Atoms(numbers=rng.integers(1, 30, size=n), positions=rng.standard_normal((n, 3)) * 3)
              for n in sizes]
    src = tmp_path / "frames.extxyz"
    ase.io.write(src, frames, format="extxyz")
    out = tmp_path / "packed"
    manifest = pack([str(src)], str(out), shard_records=int(rng.integers(7, 30)), progress=False)
    local = [RecordReader(str(out / s["path"])) for s in manifest["shards"]]
    expected = [reader[i] for reader in local for i in range(len(reader))]
    with h.Nginx(str(out), str(tmp_path / "nginx")) as server:
        ds = StreamingDataset(server.url + "/manifest.json", cache_bytes=64 << 10, shuffle=False)
        got = list(ds)
    assert len(got) == len(expected) == len(frames)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for key in e:
            np.testing.assert_array_equal(np.asarray(g[key]), np.asarray(e[key]), err_msg=key)
