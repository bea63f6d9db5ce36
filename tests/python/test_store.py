"""The record store from Python: round trips against the records written (bitwise), zero-copy
views, batch reads, ASE conversion, fork/thread safety, and one test per failure mode."""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading

import numpy as np
import pytest

from tpfkit.data import RecordReader, RecordWriter, atoms_to_record, record_to_atoms

CODECS = ["none", "zstd", "lz4"]


def make_record(rng: np.random.Generator, n_atoms: int, i: int) -> dict:
    rec = {
        "positions": rng.standard_normal((n_atoms, 3)).astype(np.float32),
        "atomic_numbers": rng.integers(1, 119, n_atoms).astype(np.uint8),
        "energy": float(rng.standard_normal()),
        "forces": rng.standard_normal((n_atoms, 3)).astype(np.float32),
        "cell": rng.standard_normal((3, 3)),
        "pbc": rng.integers(0, 2, 3).astype(bool),
        "stress": rng.standard_normal(6),
        "identifier": f"rec-{i}-é",
    }
    if i % 3 == 0:  # protein-like extras, so layouts vary within a file
        rec["residue_index"] = rng.integers(-5, 500, n_atoms).astype(np.int32)
        rec["atom_names"] = np.array([b"CA", b"N", b"OXT", b"C"] * n_atoms, dtype="S3")[:n_atoms]
        rec["b_factors"] = rng.random(n_atoms).astype(np.float32)
        rec["pair_mask"] = rng.integers(0, 2, (n_atoms, n_atoms)).astype(bool)
        rec["resolution"] = 2.5
    return rec


def make_records(seed: int, count: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 2, 3, 63, 64, 65, 127] + list(rng.integers(1, 300, max(0, count - 8)))
    return [make_record(rng, int(sizes[i % len(sizes)]), i) for i in range(count)]


def assert_same(got: dict, want: dict, where: str) -> None:
    assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
    for key, w in want.items():
        g = got[key]
        if isinstance(w, str):
            assert g == w, f"{where}: {key}"
            continue
        w = np.asarray(w)
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{where}: {key} {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        assert g.tobytes() == w.tobytes(), f"{where}: {key} differs"


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_single_and_batch(tmp_path, seed, codec):
    records = make_records(seed, 60)
    path = tmp_path / "a.tpf"
    with RecordWriter(path, compression=codec) as w:
        for r in records[:30]:
            w.append(r)
        w.commit()
        w.append_batch(records[30:])
    r = RecordReader(path)
    assert len(r) == 60 and r.generation == 3
    for i, want in enumerate(records):
        assert_same(r[i], want, f"seed={seed} record {i}")
    assert_same(r[-1], records[-1], f"seed={seed} record -1")
    with pytest.raises(IndexError):
        r[60]

    # Batches: 0-d fields stacked, the rest concatenated with per-record lengths.
    rng = np.random.default_rng(seed)
    plain = [i for i in range(60) if i % 3 != 0]
    idx = rng.choice(plain, size=25, replace=True)
    batch = r.read_batch(idx)
    for key in ("positions", "forces", "atomic_numbers"):
        want = np.concatenate([records[i][key] for i in idx])
        assert batch[key].tobytes() == want.tobytes(), f"seed={seed} {key}"
        assert list(batch["_len_" + key]) == [len(records[i][key]) for i in idx]
    assert np.array_equal(batch["energy"], [records[i]["energy"] for i in idx])
    assert np.array_equal(batch["cell"].reshape(-1, 3, 3), np.stack([records[i]["cell"] for i in idx]))
    assert list(batch["identifier"]) == [records[i]["identifier"] for i in idx]


@pytest.mark.parametrize("codec", CODECS)
def test_large_batches_match_single_reads(tmp_path, seed, codec):
    """Batches of many chunks (decoded on the thread pool), over many layouts, with repeats."""
    rng = np.random.default_rng(seed)
    records = [make_record(rng, int(rng.integers(0, 80)), 3 * k + 1) for k in range(300)]
    path = tmp_path / "l.tpf"
    with RecordWriter(path, compression=codec) as w:
        w.append_batch(records)
    r = RecordReader(path)
    for size in (1, 31, 32, 33, 257, 1000):
        idx = rng.integers(0, len(records), size)
        batch = r.read_batch(idx)
        where = f"seed={seed} codec={codec} size={size}"
        for key in ("positions", "forces", "atomic_numbers"):
            want = np.concatenate([records[i][key] for i in idx])
            assert batch[key].dtype == want.dtype and batch[key].tobytes() == want.tobytes(), f"{where} {key}"
            assert list(batch["_len_" + key]) == [len(records[i][key]) for i in idx], where
        for key in ("energy", "cell", "pbc", "stress"):
            want = np.stack([np.asarray(records[i][key]) for i in idx])
            assert batch[key].dtype == want.dtype, f"{where} {key}"
            assert batch[key].tobytes() == want.tobytes(), f"{where} {key}"
        assert list(batch["identifier"]) == [records[i]["identifier"] for i in idx], where


def test_read_batch_stack_and_errors(tmp_path, seed):
    rng = np.random.default_rng(seed)
    same = [make_record(rng, 7, 1) for _ in range(5)]
    for rec in same:
        del rec["identifier"]
    path = tmp_path / "s.tpf"
    with RecordWriter(path) as w:
        w.append_batch(same)
        w.append({"positions": np.zeros((3, 3), np.float32)})
    r = RecordReader(path)
    stacked = r.read_batch([4, 0, 2], stack=True)
    assert stacked["positions"].shape == (3, 7, 3)
    assert np.array_equal(stacked["forces"][1], same[0]["forces"])
    assert r.read_batch([]) == {}
    with pytest.raises(ValueError, match="same keys in every record"):
        r.read_batch([0, 5])
    with pytest.raises(IndexError, match="out of range"):
        r.read_batch([0, 6])
    with pytest.raises(ValueError, match="1-d sequence of integers"):
        r.read_batch([[0, 1]])


def test_read_batch_of_text_of_different_widths(tmp_path):
    recs = [{"atom_names": np.array([b"C", b"CA"]), "name": "x"},
            {"atom_names": np.array([b"OXT"]), "name": "ångström"},
            {"atom_names": np.array([], dtype="S1"), "name": ""}]
    with RecordWriter(tmp_path / "t.tpf") as w:
        w.append_batch(recs)
    batch = RecordReader(tmp_path / "t.tpf").read_batch([1, 0, 2])
    assert list(batch["atom_names"]) == [b"OXT", b"C", b"CA"]
    assert list(batch["_len_atom_names"]) == [1, 2, 0]
    assert list(batch["name"]) == ["ångström", "x", ""]


def test_columnar_append_batch_matches_single_appends(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = 40
    cols = {
        "positions": rng.standard_normal((n, 64, 3)).astype(np.float32),
        "atomic_numbers": rng.integers(1, 90, (n, 64)).astype(np.uint8),
        "energy": rng.standard_normal(n),
        "forces": rng.standard_normal((n, 64, 3)).astype(np.float32),
        "cell": rng.standard_normal((n, 3, 3)),
        "pbc": np.ones((n, 3), bool),
    }
    with RecordWriter(tmp_path / "c.tpf", compression="lz4") as w:
        w.append_batch(cols)
    r = RecordReader(tmp_path / "c.tpf")
    for i in range(n):
        assert_same(r[i], {k: v[i] for k, v in cols.items()}, f"seed={seed} record {i}")
    with pytest.raises(ValueError, match="same leading record axis"):
        RecordWriter(tmp_path / "d.tpf").append_batch({"a": np.zeros((3, 2)), "b": np.zeros((4, 2))})


def test_positions_float32_by_default_float64_when_asked(tmp_path):
    pos = np.random.default_rng(0).standard_normal((5, 3))
    for dtype in ("float32", "float64"):
        with RecordWriter(tmp_path / f"{dtype}.tpf", positions_dtype=dtype) as w:
            w.append({"positions": pos, "atomic_numbers": np.ones(5, np.uint8)})
        got = RecordReader(tmp_path / f"{dtype}.tpf")[0]["positions"]
        assert got.dtype == np.dtype(dtype)
        assert np.array_equal(got, pos.astype(dtype))


def test_zero_copy_views_are_read_only_and_outlive_the_reader(tmp_path, seed):
    records = make_records(seed, 5)
    with RecordWriter(tmp_path / "z.tpf") as w:
        w.append_batch(records)
    r = RecordReader(tmp_path / "z.tpf")
    rec = r[4]
    pos = rec["positions"]
    assert not pos.flags.writeable and not pos.flags.owndata  # a view into the mapping
    with pytest.raises(ValueError):
        pos[0, 0] = 1.0
    del r, rec
    gc.collect()
    assert pos.tobytes() == records[4]["positions"].tobytes()


@pytest.mark.parametrize("codec", CODECS)
def test_read_copies_and_records_iterate_in_any_order(tmp_path, seed, codec):
    records = make_records(seed, 40)
    path = tmp_path / "c.tpf"
    with RecordWriter(path, compression=codec) as w:
        w.append_batch(records)
    r = RecordReader(path)
    rng = np.random.default_rng(seed)
    order = list(rng.integers(-40, 40, 100))  # repeats and negative indices
    for i, got in zip(order, r.records(order), strict=True):
        assert_same(got, records[i], f"seed={seed} record {i}")
    for i, got in enumerate(r.records()):
        assert_same(got, records[i], f"seed={seed} record {i}")
    assert [float(rec["energy"]) for rec in r] == [rec["energy"] for rec in records]
    with pytest.raises(IndexError, match="indices\\[1\\] = 40 is out of range"):
        r.records([0, 40])
    for i in (0, 3, 39):
        rec = r.read(i)
        assert_same(rec, records[i], f"seed={seed} record {i}")
        assert_same(r.read(i, copy=False), records[i], f"seed={seed} record {i}")
        pos = rec["positions"]
        assert pos.flags.writeable and pos.flags.owndata  # a copy of its own
        pos[...] = 7  # changes nothing stored
        assert_same(r.read(i), records[i], f"seed={seed} record {i}")
        assert not r[i]["positions"].flags.writeable  # views stay read-only, compressed or not
    with pytest.raises(IndexError):
        r.read(40)


def test_uncommitted_records_are_invisible_and_exceptions_do_not_commit(tmp_path, seed):
    records = make_records(seed, 10)
    path = tmp_path / "u.tpf"
    w = RecordWriter(path)
    w.append_batch(records[:4])
    w.commit()
    w.append_batch(records[4:])
    assert len(RecordReader(path)) == 4
    w.close()
    with pytest.raises(RuntimeError, match="boom"):
        with RecordWriter(path) as w2:
            w2.append(records[9])
            raise RuntimeError("boom")
    assert len(RecordReader(path)) == 4
    with RecordWriter(path) as w3:  # appends after the last commit
        assert w3.committed == 4
        w3.append_batch(records[4:])
    r = RecordReader(path)
    for i in range(10):
        assert_same(r[i], records[i], f"seed={seed} record {i}")


def test_bad_records_name_the_field(tmp_path):
    w = RecordWriter(tmp_path / "b.tpf")
    cases = [
        ({"positions": np.zeros((4, 2))}, "positions.*shape \\[n_atoms, 3\\]"),
        ({"positions": np.zeros((4, 3)), "forces": np.zeros((5, 3))}, "'forces' has 5 atoms"),
        ({"cell": np.zeros(3)}, "'cell' must have shape \\[3, 3\\]"),
        ({"energy": np.zeros(2)}, "'energy' must be a scalar"),
        ({"atomic_numbers": np.zeros(3)}, "'atomic_numbers' must be integers"),
        ({"x": np.array([object()])}, "'x' has no numeric or text dtype"),
        ({"_private": 1.0}, "reserved"),
        ({"x": np.zeros(3, np.complex64)}, "'x' has dtype complex64"),
        ({"identifier": 5}, "'identifier' must be a str"),
    ]
    for rec, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            w.append(rec)
    with pytest.raises(ValueError, match="compression must be"):
        RecordWriter(tmp_path / "c.tpf", compression="gzip")
    assert len(w) == 0


def test_ase_atoms_in_and_out(tmp_path, seed):
    from ase.build import bulk, molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    crystal = bulk("NaCl", "rocksalt", a=5.6) * (2, 1, 1)
    crystal.calc = SinglePointCalculator(crystal, energy=-3.25, forces=rng.standard_normal((len(crystal), 3)),
                                         stress=rng.standard_normal(6))
    mol = molecule("CH3CH2OH")
    mol.set_initial_charges(rng.standard_normal(len(mol)))
    mol.info["identifier"] = "ethanol"
    with RecordWriter(tmp_path / "ase.tpf", positions_dtype="float64") as w:
        w.append(crystal)
        w.append_batch([mol])
    r = RecordReader(tmp_path / "ase.tpf")
    back = r.atoms(0)
    assert (back.numbers == crystal.numbers).all() and np.array_equal(back.positions, crystal.positions)
    assert np.array_equal(back.cell[:], crystal.cell[:]) and (back.pbc == crystal.pbc).all()
    assert back.get_potential_energy() == -3.25
    assert np.allclose(back.get_forces(), crystal.get_forces(), atol=0, rtol=0)
    assert np.array_equal(back.get_stress(), crystal.get_stress())
    m = record_to_atoms(r[1])
    assert m.get_chemical_formula() == mol.get_chemical_formula()
    assert np.array_equal(m.get_initial_charges(), mol.get_initial_charges())
    assert m.info["identifier"] == "ethanol" and not m.pbc.any()
    assert "cell" not in atoms_to_record(mol)


def _read_all(path: str, indices: list[int], queue) -> None:
    r = RecordReader(path)
    queue.put([float(r[i]["positions"].sum()) for i in indices])


def test_fork_and_threads_share_a_reader(tmp_path, seed):
    records = make_records(seed, 40)
    path = str(tmp_path / "f.tpf")
    with RecordWriter(path, compression="zstd") as w:
        w.append_batch(records)
    r = RecordReader(path)
    want = [float(rec["positions"].sum()) for rec in records]
    # A reader opened before fork() is used in the children.
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=lambda q, part=part: q.put([float(r[i]["positions"].sum()) for i in part]),
                         args=(queue,)) for part in (range(0, 40, 2), range(1, 40, 2))]
    for p in procs:
        p.start()
    results = sorted([queue.get(timeout=60) for _ in procs], key=lambda v: v[0] == want[1])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == want[0::2] and results[1] == want[1::2]
    # Threads.
    errors = []

    def work(k):
        for i in range(k, 40, 4):
            if float(r[i]["positions"].sum()) != want[i]:
                errors.append(i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"seed={seed}"


def test_torch_dataloader_workers(tmp_path, seed):
    torch = pytest.importorskip("torch")
    records = make_records(seed, 24)
    path = str(tmp_path / "d.tpf")
    with RecordWriter(path) as w:
        w.append_batch(records)
    reader = RecordReader(path)

    class Dataset(torch.utils.data.Dataset):
        def __len__(self):
            return len(reader)

        def __getitem__(self, i):
            return float(reader[i]["energy"])

    loader = torch.utils.data.DataLoader(Dataset(), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    assert [float(e) for e in loader] == [rec["energy"] for rec in records]
    # Under the spawn start method a reader travels by pickle: it reopens by path.
    import pickle
    again = pickle.loads(pickle.dumps(reader))
    assert_same(again[3], records[3], f"seed={seed}")


# ---- failure modes: one test each ----------------------------------------------------------------

@pytest.fixture
def store(tmp_path, seed):
    """A file with generations 1 (empty), 2 (6 records) and 3 (10 records)."""
    records = make_records(seed, 10)
    path = tmp_path / "f.tpf"
    with RecordWriter(path, compression="lz4") as w:
        w.append_batch(records[:6])
    with RecordWriter(path, compression="lz4") as w:
        w.append_batch(records[6:])
    return path, records


def flip(path, offset):
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x5A
    path.write_bytes(bytes(b))


def test_failure_empty_file(tmp_path):
    (tmp_path / "e.tpf").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        RecordReader(tmp_path / "e.tpf")


def test_failure_truncated_file(store):
    path, _ = store
    data = path.read_bytes()
    for keep in (50, 200, len(data) - 1):
        path.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="is truncated"):
            RecordReader(path)


def test_failure_flipped_byte_in_record(store, seed):
    path, records = store
    r = RecordReader(path)
    flip(path, 200)  # inside record 0 (records start at byte 128)
    with pytest.raises(ValueError, match="record 0 is corrupt \\(checksum mismatch\\)"):
        RecordReader(path)[0]
    assert_same(RecordReader(path)[1], records[1], f"seed={seed}")
    del r


def test_failure_flipped_byte_in_a_record_of_a_large_batch(tmp_path, seed):
    rng = np.random.default_rng(seed)
    records = [make_record(rng, 20, 3 * k + 1) for k in range(200)]
    path = tmp_path / "c.tpf"
    with RecordWriter(path) as w:
        w.append_batch(records)
    data = path.read_bytes()
    flip(path, data.index(records[150]["forces"].tobytes()) + 7)
    idx = rng.permutation(200)
    with pytest.raises(ValueError, match="record 150 is corrupt \\(checksum mismatch\\)"):
        RecordReader(path).read_batch(idx)
    batch = RecordReader(path, verify_checksums=False).read_batch(idx)  # unchecked: bytes as stored
    assert np.array_equal(batch["energy"], [records[i]["energy"] for i in idx])


def test_failure_flipped_byte_in_index(store):
    path, _ = store
    flip(path, len(path.read_bytes()) - 10)
    with pytest.raises(ValueError, match="index checksum mismatch"):
        RecordReader(path)


def test_failure_flipped_byte_in_current_header_is_an_error_unless_recovering(store, seed, capsys):
    """Issue 20, item 3: a damaged current slot must not silently drop the last commit."""
    from tpfkit.cli import main as tpf_main

    path, records = store
    flip(path, 0 + 20)  # generation 3 (10 records) lives in slot 0
    with pytest.raises(ValueError, match="header slot 0 is damaged.*generation 2.*recover=True"):
        RecordReader(path)
    with pytest.raises(ValueError, match="header slot 0 is damaged.*recover=True"):
        RecordWriter(path)  # appending would drop generation 3's bytes for good
    with pytest.warns(RuntimeWarning, match="header slot 0 is damaged.*reading generation 2"):
        r = RecordReader(path, recover=True)
    assert len(r) == 6 and r.generation == 2
    assert_same(r[5], records[5], f"seed={seed}")
    capsys.readouterr()
    assert tpf_main(["inspect", str(path)]) == 1
    text = capsys.readouterr().out
    assert "header 0    invalid: checksum mismatch" in text, text
    assert "damaged     header slot 0" in text and "recover=True" in text, text
    assert "generation  2" in text and "records     6" in text, text
    flip(path, 64 + 20)
    with pytest.raises(ValueError, match="no intact header"):
        RecordReader(path, recover=True)


def test_failure_flipped_byte_in_the_older_header_is_harmless(store, seed, capsys):
    """Issue 20, item 2: the version field is read only from a slot whose checksum holds."""
    from tpfkit.cli import main as tpf_main

    path, records = store
    for at in (64 + 8, 64 + 20, 64 + 60):  # slot 1 holds generation 2: version, generation, checksum
        flip(path, at)
        r = RecordReader(path)
        assert len(r) == 10 and r.generation == 3
        assert_same(r[9], records[9], f"seed={seed}")
        capsys.readouterr()
        assert tpf_main(["inspect", str(path)]) == 0
        assert "header 1    invalid: checksum mismatch" in capsys.readouterr().out
        flip(path, at)
    with RecordWriter(path) as w:  # the next commit rewrites the damaged slot
        w.append(records[0])
    assert len(RecordReader(path)) == 11


def test_failure_unfinished_first_commit(tmp_path):
    """Issue 20, item 4: a file whose first commit never completed says so."""
    path = tmp_path / "u.tpf"
    path.write_bytes(bytes(128) + b"TPFINDEX" + bytes(24))  # header zeroed, index written
    with pytest.raises(ValueError, match="unfinished first commit"):
        RecordReader(path)
    with pytest.raises(ValueError, match="unfinished first commit.*overwrite=True"):
        RecordWriter(path)
    with RecordWriter(path, overwrite=True) as w:
        w.append({"energy": 1.0})
    assert RecordReader(path)[0]["energy"] == 1.0


def test_failure_wrong_magic(tmp_path):
    (tmp_path / "m.tpf").write_bytes(b"PK\x03\x04" + bytes(300))
    with pytest.raises(ValueError, match="not a TurboPairFormer store"):
        RecordReader(tmp_path / "m.tpf")


def test_failure_second_writer(store):
    path, _ = store
    w = RecordWriter(path)
    with pytest.raises(RuntimeError, match="locked by another writer"):
        RecordWriter(path)
    w.close()
    RecordWriter(path).close()


def test_failure_missing_file(tmp_path):
    """Issue 20, item 4: a missing file is FileNotFoundError, as open() says."""
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        RecordReader(tmp_path / "nope.tpf")
    assert e.value.filename == str(tmp_path / "nope.tpf")


OVERWRITE_UNDER_A_READER = """
import sys
from tpfkit.data import RecordReader as R, RecordWriter as W
p = sys.argv[1]
with W(p, overwrite=True) as w:
    for i in range(5000):
        w.append({"energy": float(i)})
r = R(p)
with W(p, overwrite=True) as w:
    w.append({"energy": -1.0})
assert len(r) == 5000 and r[4999]["energy"] == 4999.0, (len(r), r[4999])
assert len(R(p)) == 1 and R(p)[0]["energy"] == -1.0
print("ok")
"""


def test_failure_overwrite_under_a_reader(tmp_path):
    """Issue 20, item 1: overwrite=True (as `tpf pack` does) replaces the file by a new one, so a
    reader of the old one keeps reading it. In a subprocess: the failure is a SIGBUS."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", OVERWRITE_UNDER_A_READER, str(tmp_path / "o.tpf")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr)


def test_failure_crash_during_overwrite_keeps_the_old_contents(tmp_path, seed):
    """Issue 20, item 1: until the new file commits, a crash (SIGKILL) leaves the old one whole;
    the next writer removes the dead writer's partial file."""
    import signal

    records = make_records(seed, 12)
    path = tmp_path / "k.tpf"
    with RecordWriter(path) as w:
        w.append_batch(records)
    for commit_first in (False, True):
        pid = os.fork()
        if pid == 0:
            try:
                w = RecordWriter(path, overwrite=True)
                w.append(records[0])
                if commit_first:
                    w.commit()
                    w.append(records[1])
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        # k.tpf, and the dead writer's partial file unless its commit renamed it into place (this
        # writer removed the previous one's).
        assert len(os.listdir(tmp_path)) == (1 if commit_first else 2), os.listdir(tmp_path)
        r = RecordReader(path)
        want = records[:1] if commit_first else records
        assert len(r) == len(want)
        for i, rec in enumerate(want):
            assert_same(r[i], rec, f"seed={seed} record {i}")
    assert os.listdir(tmp_path) == ["k.tpf"]
