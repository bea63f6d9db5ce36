"""`tpf train` and its parts: chains from atoms and from the shipped files, distogram targets, crops,
a tiny run whose loss falls, training streamed from local shards and from nginx alike, and resumes
(of resumes) that reproduce the uninterrupted run's losses."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from stream_harness import FaultServer, Nginx
from tpfkit.cli import main
from tpfkit.data import RecordWriter, StreamingDataset
from tpfkit.data.pack import pack, pack_records, write_manifest
from tpfkit.data.structures import file_records
from tpfkit.train import loop
from tpfkit.train.data import (
    CropBatches,
    MemoryChains,
    held_out_chains,
    is_held_out,
    load_chains,
    split_by_entry,
)
from tpfkit.train.features import (
    RESIDUE_NAMES,
    UNKNOWN_TYPE,
    chains_from_atoms,
    distogram_targets,
    make_batch,
)
from tpfkit.train.loop import TrainConfig, lr_factor, train
from tpfkit.train.model import ModelConfig
from tpfkit.train.split import entry_bucket, manifest_buckets

DATA = Path(__file__).resolve().parents[2] / "data" / "structures"
SMALL_FILES = ["1UBQ.pdb.gz", "1EJG.pdb.gz", "1A8O.pdb.gz", "1LJO.pdb.gz", "1D4V.pdb.gz"]


@pytest.fixture(scope="module")
def small_structures(tmp_path_factory) -> Path:
    """Five of the shipped entries, so the tests read little."""
    d = tmp_path_factory.mktemp("structures")
    for f in SMALL_FILES:
        (d / f).write_bytes((DATA / f).read_bytes())
    return d


@pytest.fixture(scope="module")
def small_data(small_structures, tmp_path_factory) -> Path:
    """The five entries packed by tpf pack, one record per chain, as the main job packs them."""
    out = tmp_path_factory.mktemp("shards")
    pack([str(p) for p in sorted(small_structures.iterdir())], str(out), per_chain=True,
         shard_records=3, progress=False)
    return out


@pytest.fixture(scope="module")
def entry_data(tmp_path_factory) -> Path:
    """Entries with several protein chains, one record per entry: a record's chains may then
    straddle two batches (and a checkpoint)."""
    out = tmp_path_factory.mktemp("entries")
    files = ["1A8O.pdb.gz", "1UBQ.pdb.gz", "1CS4.pdb.gz", "1D4V.pdb.gz", "1A0Q.pdb.gz"]
    pack([str(DATA / f) for f in files], str(out), shard_records=2, progress=False)
    return out


WIDE_RECORDS, WIDE_SHARD_RECORDS = 240, 60


@pytest.fixture(scope="module")
def wide_data(tmp_path_factory) -> Path:
    """A store of many records (1UBQ's chain under 240 entry names, one record each, 4 shards),
    packed as tpf pack packs: its manifest carries the records' entry hashes."""
    out = tmp_path_factory.mktemp("wide")
    ubq = next(file_records(str(DATA / "1UBQ.pdb.gz"), per_chain=True))
    pack_records(({**ubq, "identifier": f"E{i:04d}_A"} for i in range(WIDE_RECORDS)), str(out),
                 shard_records=WIDE_SHARD_RECORDS)
    return out


def same_chains(a, b) -> None:
    assert [c.name for c in a] == [c.name for c in b]
    for x, y in zip(a, b):
        for field in ("aatype", "residue_index", "positions", "position_mask"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field), err_msg=x.name)


def test_chains_from_atoms_pseudo_beta_and_filters():
    # residue 1 ALA with CB, 2 GLY (CA is its pseudo-beta), 3 SER without CB, 4 MSE, then a water
    atoms = [("A", 1, "ALA", "CA", 0), ("A", 1, "ALA", "CB", 1), ("A", 2, "GLY", "CA", 2),
             ("A", 2, "GLY", "N", 3), ("A", 3, "SER", "CA", 4), ("A", 4, "MSE", "CB", 5),
             ("A", 5, "HOH", "O", 6), ("B", 1, "ALA", "CB", 7)]
    pos = np.arange(len(atoms) * 3, dtype=np.float32).reshape(-1, 3)
    chains = chains_from_atoms("X", *zip(*[a[:4] for a in atoms]), pos, min_residues=2)
    assert [c.name for c in chains] == ["X_A"]  # chain B is shorter than min_residues
    c = chains[0]
    names = [RESIDUE_NAMES[t] for t in c.aatype]
    assert names == ["ALA", "GLY", "SER", "MET"]
    np.testing.assert_array_equal(c.residue_index, [1, 2, 3, 4])
    np.testing.assert_array_equal(c.position_mask, [True, True, False, True])
    np.testing.assert_array_equal(c.positions[[0, 1, 3]], pos[[1, 2, 5]])
    with pytest.raises(ValueError, match="positions must have one entry per atom"):
        chains_from_atoms("X", ["A"], [1], ["ALA"], ["CA"], pos)


def test_shipped_data_reads_as_at_least_50_chains():
    chains = load_chains(str(DATA), progress=False)
    assert len(chains) >= 50
    ubq = next(c for c in chains if c.name == "1UBQ_A")
    seq = "".join("ARNDCQEGHILKMFPSTWYV"[t] for t in ubq.aatype[:10])
    assert seq == "MQIFVKTLTG" and len(ubq) == 76 and ubq.position_mask.all()
    # Consecutive C-alpha/C-beta atoms of a real chain are 3.8-7 angstrom apart.
    steps = np.linalg.norm(np.diff(ubq.positions, axis=0), axis=1)
    assert 3.0 < steps.min() and steps.max() < 7.5


def test_shards_local_and_over_http_give_the_structures_chains(small_structures, small_data,
                                                                tmp_path):
    expected = load_chains(str(small_structures), progress=False)
    assert len(expected) == len(SMALL_FILES)
    same_chains(load_chains(str(small_data), progress=False), expected)
    same_chains(load_chains(str(small_data / "shard-00001.tpf"), progress=False), expected[3:])
    with Nginx(str(small_data), str(tmp_path / "nginx")) as server:
        same_chains(load_chains(f"{server.url}/manifest.json", progress=False), expected)


def test_load_chains_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_chains(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="holds neither manifest.json nor mmCIF/PDB"):
        load_chains(str(tmp_path))
    with RecordWriter(tmp_path / "atoms.tpf") as w:
        w.append({"positions": np.zeros((2, 3)), "atomic_numbers": np.array([1, 8]),
                  "identifier": "water"})
    with pytest.raises(ValueError, match="record 'water' has no .*not a protein structure"):
        load_chains(str(tmp_path / "atoms.tpf"))


def test_distogram_targets_match_brute_force():
    gen = torch.Generator().manual_seed(7)
    pos = torch.randn(2, 9, 3, generator=gen) * 8
    mask = torch.rand(2, 9, generator=gen) > 0.2
    boundaries = torch.linspace(2, 22, 63)
    targets, pair_mask = distogram_targets(pos, mask, boundaries)
    for b in range(2):
        for i in range(9):
            for j in range(9):
                d = float(np.linalg.norm(pos[b, i].numpy().astype(np.float64)
                                         - pos[b, j].numpy().astype(np.float64)))
                assert targets[b, i, j] == sum(d >= float(x) for x in boundaries), (b, i, j, d)
                assert pair_mask[b, i, j] == (mask[b, i] and mask[b, j])


def test_crops_padding_and_determinism(small_data):
    chains = load_chains(str(small_data), progress=False)
    one, two = (CropBatches(MemoryChains(chains, 5), 3, 40, seed=5) for _ in range(2))
    a, b = one.next(), two.next()
    c = one.next()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not all(torch.equal(a[k], c[k]) for k in a)
    short = min(chains, key=len)
    batch = make_batch([short], [0], len(short) + 5)
    assert batch["token_mask"][0].sum() == len(short)
    assert not batch["token_mask"][0, len(short):].any()
    assert (batch["aatype"][0, len(short):] == UNKNOWN_TYPE).all()
    with pytest.raises(ValueError, match="crop start"):
        make_batch([short], [len(short)], 8)


def test_split_keeps_entries_whole(small_data):
    chains = load_chains(str(small_data), progress=False)
    train_chains, val_chains = split_by_entry(chains, 0.5)
    entries = lambda cs: {c.name.rsplit("_", 1)[0] for c in cs}  # noqa: E731
    assert not entries(train_chains) & entries(val_chains)
    assert len(train_chains) + len(val_chains) == len(chains)


def test_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(99, cfg) == pytest.approx(0.1, abs=1e-3)
    cfg.schedule = "constant"
    assert lr_factor(99, cfg) == 1.0


def tiny_config(data: Path, out: Path, **kw) -> TrainConfig:
    model = ModelConfig(blocks=1, c_z=16, heads=2, head_dim=8, transition_n=2)
    base = dict(data=str(data), out=str(out), steps=40, batch_size=2, crop=24, lr=3e-3, warmup=5,
                val_fraction=0.0, eval_every=1000, checkpoint_every=1000, model=model)
    base.update(kw)
    return TrainConfig(**base)


def test_tiny_training_run_loss_decreases(small_data, tmp_path):
    summary = train(tiny_config(small_data, tmp_path / "run"), progress=False)
    assert summary["nonfinite_steps"] == []
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41))
    assert Path(summary["plot"]).stat().st_size > 0


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def copy_checkpoint(src: Path, dst: Path, step: int) -> None:
    dst.mkdir(exist_ok=True)
    name = f"checkpoint-{step:07d}.pt"
    (dst / name).write_bytes((src / name).read_bytes())


@pytest.mark.parametrize("data", ["small_data", "entry_data"])
def test_resume_mid_epoch_and_resume_of_a_resume_see_the_same_batches(data, tmp_path, request):
    """Streamed from shards (one chain a record, or whole entries whose chains straddle batches):
    a run resumed from a checkpoint, and that run resumed again, give the uninterrupted run's
    losses bit for bit, through several epochs of the loader."""
    data = request.getfixturevalue(data)
    # A constant schedule after warm-up: the runs that stop early have fewer steps, and a cosine
    # schedule's learning rates depend on the number of steps.
    cfg = lambda out, steps: tiny_config(data, out, steps=steps, checkpoint_every=3,  # noqa: E731
                                         schedule="constant")
    full = tmp_path / "full"
    train(cfg(full, 9), progress=False)
    expected = losses(full)
    assert sorted(expected) == list(range(1, 10))
    first = tmp_path / "first"
    copy_checkpoint(full, first, 3)
    train(cfg(first, 6), resume=str(first), progress=False)
    second = tmp_path / "second"
    copy_checkpoint(first, second, 6)
    train(cfg(second, 9), resume=str(second), progress=False)
    got = {**{s: v for s, v in losses(first).items() if s > 3},
           **{s: v for s, v in losses(second).items() if s > 6}}
    assert got == {s: v for s, v in expected.items() if s > 3}


def test_training_streamed_from_nginx_gives_the_local_losses(small_data, tmp_path):
    """`tpf train --data http://...` over a served copy of the shards: the same batches, so the
    same losses, as from the local files (DataLoader workers included)."""
    local = tmp_path / "local"
    train(tiny_config(small_data, local, steps=5), progress=False)
    with Nginx(str(small_data), str(tmp_path / "nginx")) as server:
        rc = main(["train", "--data", f"{server.url}/manifest.json", "--out", str(tmp_path / "http"),
                   "--steps", "5", "--batch-size", "2", "--crop", "24", "--lr", "3e-3",
                   "--warmup", "5", "--val-fraction", "0", "--blocks", "1", "--c-z", "16",
                   "--heads", "2", "--head-dim", "8", "--loader-workers", "1", "--no-progress"])
    assert rc == 0
    assert losses(tmp_path / "http") == losses(local)


def test_cli_train_prints_final_loss_and_plot(small_data, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["train", "--data", str(small_data), "--out", str(out), "--steps", "3",
               "--blocks", "1", "--c-z", "8", "--heads", "2", "--head-dim", "4", "--crop", "16",
               "--no-progress", "--json", str(tmp_path / "s.json")])
    text = capsys.readouterr().out
    assert rc == 0
    assert "final loss:" in text and f"loss plot: {out / 'loss.png'}" in text
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 3
    rc = main(["train", "--data", str(small_data), "--crop", "0", "--out", str(out)])
    assert rc == 2 and "crop must be >= 1" in capsys.readouterr().err


def test_chains_round_trip_through_npz(tmp_path):
    """The .npz that carries the training chains to machines without the record store."""
    from tpfkit.train.data import load_chains, save_chains

    chains = load_chains(str(DATA), progress=False)
    save_chains(chains, str(tmp_path / "chains.npz"))
    again = load_chains(str(tmp_path / "chains.npz"))
    assert [c.name for c in again] == [c.name for c in chains]
    for a, b in zip(chains, again):
        for field in ("aatype", "residue_index", "positions", "position_mask"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), (a.name, field)
    # Trained from memory (as on a build without the record store), resumed the same way.
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train(tiny_config(tmp_path / "chains.npz", full, steps=4, checkpoint_every=2,
                      schedule="constant"), progress=False)
    copy_checkpoint(full, resumed, 2)
    train(tiny_config(tmp_path / "chains.npz", resumed, steps=4, checkpoint_every=2,
                      schedule="constant"), resume=str(resumed), progress=False)
    assert {k: v for k, v in losses(resumed).items() if k > 2} == \
        {k: v for k, v in losses(full).items() if k > 2}


def test_held_out_records_come_from_the_manifest_or_from_reading_the_store(wide_data, tmp_path):
    """tpf pack names each record's entry hash in the manifest; the held-out chains read through
    it (only the held-out records) are those a store without the hashes gives by reading its
    records in order: the first val_records held-out records in store order."""
    manifest = json.loads((wide_data / "manifest.json").read_text())
    assert list(manifest_buckets(manifest)) == [entry_bucket(f"E{i:04d}")
                                                for i in range(WIDE_RECORDS)]
    expected = [f"E{i:04d}_A" for i in range(WIDE_RECORDS) if entry_bucket(f"E{i:04d}") < 2000][:5]
    location = str(wide_data / "manifest.json")
    fast = held_out_chains(StreamingDataset(location, shuffle=False), location, 0.2, 5,
                           progress=False)
    assert [c.name for c in fast] == expected and all(is_held_out(c, 0.2) for c in fast)
    old = tmp_path / "old"
    shutil.copytree(wide_data, old)
    for shard in manifest["shards"]:
        del shard["entry_hash"]
    write_manifest(manifest, str(old / "manifest.json"))
    location = str(old / "manifest.json")
    with pytest.warns(UserWarning, match="entry hashes"):
        slow = held_out_chains(StreamingDataset(location, shuffle=False), location, 0.2, 5,
                               progress=False)
    same_chains(slow, fast)


def test_training_over_http_starts_without_reading_the_store(wide_data, tmp_path, monkeypatch):
    """`tpf train --data http://.../manifest.json` reads before its first step the manifest, the
    shards' headers and indexes and the val_records held-out records (for the step-0 validation
    loss) and nothing else; its first step reads the first records of the stream within the
    loader's budget: far below the store either way."""
    budget_mib, val_records = 0.25, 4
    store_bytes = json.loads((wide_data / "manifest.json").read_text())["bytes"]
    record_bytes = store_bytes / WIDE_RECORDS
    shards = WIDE_RECORDS // WIDE_SHARD_RECORDS
    seen = {}
    step = loop.Trainer.step

    def counted_step(trainer):
        served = lambda: (sum(n for p, n in server.requests.items() if p.endswith(".tpf")),  # noqa: E731
                          sum(n for p, n in server.bytes_served.items() if p.endswith(".tpf")))
        seen.setdefault(trainer.step_count, served())
        row = step(trainer)
        seen.setdefault(trainer.step_count, served())
        return row

    monkeypatch.setattr(loop.Trainer, "step", counted_step)
    with FaultServer(str(wide_data)) as server:
        rc = main(["train", "--data", f"{server.url}/manifest.json", "--out", str(tmp_path / "run"),
                   "--steps", "2", "--batch-size", "2", "--crop", "24", "--blocks", "1",
                   "--c-z", "8", "--heads", "2", "--head-dim", "4", "--val-fraction", "0.1",
                   "--val-records", str(val_records), "--cache-mib", str(budget_mib),
                   "--no-progress", "--json", str(tmp_path / "s.json")])
    assert rc == 0
    assert json.loads((tmp_path / "s.json").read_text())["val_chains"] == val_records
    (requests_0, bytes_0), (requests_1, bytes_1) = seen[0], seen[1]
    # Before step 1: a few requests per shard (header, index) and one per held-out record.
    assert requests_0 <= 4 * shards + val_records, seen
    index_bytes = shards * (4096 + 32 * WIDE_SHARD_RECORDS)
    assert bytes_0 <= index_bytes + 1.5 * val_records * record_bytes, (seen, record_bytes)
    assert bytes_0 < 0.05 * store_bytes, (seen, store_bytes)
    # Step 1: the loader runs ahead of its first batch by at most its budget.
    assert bytes_1 - bytes_0 <= budget_mib * 2**20 + 8 * record_bytes, (seen, record_bytes)
    assert bytes_1 < 0.25 * store_bytes, (seen, store_bytes)
