"""`tpf train` and its parts: chains from atoms and from the shipped files, distogram targets, crops,
a tiny run whose loss falls, training streamed from local shards and from nginx alike, and resumes
(of resumes) that reproduce the uninterrupted run's losses."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stream_harness import Nginx
from turbopairformer.cli import main
from turbopairformer.data import RecordWriter
from turbopairformer.data.pack import pack
from turbopairformer.train.data import CropBatches, MemoryChains, load_chains, split_by_entry
from turbopairformer.train.features import (
    RESIDUE_NAMES,
    UNKNOWN_TYPE,
    chains_from_atoms,
    distogram_targets,
    make_batch,
)
from turbopairformer.train.loop import TrainConfig, lr_factor, train
from turbopairformer.train.model import ModelConfig

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
    from turbopairformer.train.data import load_chains, save_chains

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
