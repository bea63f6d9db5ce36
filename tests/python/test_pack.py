"""`tpf pack` and `tpf inspect`: mmCIF/PDB (gemmi) and extxyz (ASE) to shards plus a manifest,
checked against the atoms written into the input files."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tpfkit.cli import main as tpf_main
from tpfkit.data import RecordReader

ELEMENT_Z = {"N": 7, "C": 6, "O": 8, "S": 16}
RESIDUES = {"ALA": [("N", "N"), ("CA", "C"), ("C", "C"), ("O", "O"), ("CB", "C")],
            "GLY": [("N", "N"), ("CA", "C"), ("C", "C"), ("O", "O")],
            "CYS": [("N", "N"), ("CA", "C"), ("C", "C"), ("O", "O"), ("CB", "C"), ("SG", "S")]}


def write_pdb(path, seed, name="1TST", resolution=2.1):
    """A two-chain protein (chain A: 5 residues, B: 3) with one water and an alternative
    conformation, in PDB format. Returns the atoms expected in the record, in file order."""
    rng = np.random.default_rng(seed)
    lines = [f"HEADER    TEST STRUCTURE                          01-JAN-26   {name}",
             f"REMARK   2 RESOLUTION.    {resolution:.2f} ANGSTROMS."]
    atoms = []
    serial = 1
    for chain, n_res in (("A", 5), ("B", 3)):
        for k in range(n_res):
            res = list(RESIDUES)[int(rng.integers(0, 3))]
            seq = 10 + k
            for atom_name, element in RESIDUES[res]:
                xyz = np.round(rng.uniform(-50, 50, 3), 3)
                b, occ = round(float(rng.uniform(5, 80)), 2), 1.0
                alt = " "
                if chain == "A" and k == 1 and atom_name == "CA":
                    alt, occ = "A", 0.6
                padded = f" {atom_name:<3s}" if len(atom_name) < 4 else atom_name
                lines.append(f"ATOM  {serial:5d} {padded}{alt}{res:>3s} {chain}{seq:4d}    "
                             f"{xyz[0]:8.3f}{xyz[1]:8.3f}{xyz[2]:8.3f}{occ:6.2f}{b:6.2f}          {element:>2s}")
                atoms.append(dict(name=atom_name, res=res, seq=seq, chain=chain, xyz=xyz, b=b, occ=occ,
                                  z=ELEMENT_Z[element]))
                serial += 1
                if alt == "A":  # the second conformation is dropped by the packer
                    alt_xyz = xyz + 0.5
                    lines.append(f"ATOM  {serial:5d} {padded}B{res:>3s} {chain}{seq:4d}    "
                                 f"{alt_xyz[0]:8.3f}{alt_xyz[1]:8.3f}{alt_xyz[2]:8.3f}{0.4:6.2f}{b:6.2f}          {element:>2s}")
                    serial += 1
        lines.append(f"TER   {serial:5d}      {res:>3s} {chain}{seq:4d}")
        serial += 1
    xyz = np.round(rng.uniform(-50, 50, 3), 3)
    lines.append(f"HETATM{serial:5d}  O   HOH W   1    {xyz[0]:8.3f}{xyz[1]:8.3f}{xyz[2]:8.3f}  1.00 30.00           O")
    atoms.append(dict(name="O", res="HOH", seq=1, chain="W", xyz=xyz, b=30.0, occ=1.0, z=8))
    lines.append("END")
    path.write_text("\n".join(lines) + "\n")
    return atoms


def check_record(rec, atoms, identifier, resolution):
    assert rec["identifier"] == identifier
    assert (math.isnan(resolution) and math.isnan(rec["resolution"])) or rec["resolution"] == resolution
    assert rec["positions"].dtype == np.float32
    assert np.array_equal(rec["positions"], np.array([a["xyz"] for a in atoms], dtype=np.float32))
    assert list(rec["atomic_numbers"]) == [a["z"] for a in atoms]
    assert [n.decode() for n in rec["atom_names"]] == [a["name"] for a in atoms]
    assert [n.decode() for n in rec["residue_names"]] == [a["res"] for a in atoms]
    assert list(rec["residue_index"]) == [a["seq"] for a in atoms]
    assert [c.decode() for c in rec["chain_id"]] == [a["chain"] for a in atoms]
    assert np.array_equal(rec["b_factors"], np.array([a["b"] for a in atoms], dtype=np.float32))
    assert np.array_equal(rec["occupancy"], np.array([a["occ"] for a in atoms], dtype=np.float32))


def test_pack_pdb_and_mmcif_whole_and_per_chain(tmp_path, seed, capsys):
    import gemmi

    pdb = tmp_path / "in" / "1tst.pdb"
    pdb.parent.mkdir()
    atoms = write_pdb(pdb, seed)
    cif = tmp_path / "in" / "2tst.cif"
    st = gemmi.read_structure(str(pdb))
    st.name = "2TST"
    st.info["_entry.id"] = "2TST"
    st.setup_entities()
    doc = st.make_mmcif_document()
    doc.sole_block().set_pair("_refine.ls_d_res_high", "1.85")
    doc.sole_block().set_pair("_refine.pdbx_refine_id", gemmi.cif.quote("X-RAY DIFFRACTION"))
    doc.write_file(str(cif))

    out = tmp_path / "out"
    assert tpf_main(["pack", str(tmp_path / "in"), "-o", str(out), "--quiet", "--shard-records", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["records"] == 2 and len(manifest["shards"]) == 2
    for shard in manifest["shards"]:
        data = (out / shard["path"]).read_bytes()
        assert shard["bytes"] == len(data) and shard["sha256"] == hashlib.sha256(data).hexdigest()
        assert shard["records"] == 1
    first = RecordReader(out / manifest["shards"][0]["path"])[0]
    check_record(first, atoms, "1TST", 2.1)
    second = RecordReader(out / manifest["shards"][1]["path"])[0]
    check_record(second, atoms, "2TST", 1.85)

    # One record per polymer chain: chains A and B, no water.
    out2 = tmp_path / "chains"
    assert tpf_main(["pack", str(pdb), "-o", str(out2), "--quiet", "--per-chain", "--compression", "lz4",
                     "--base-url", "https://example.org/data/"]) == 0
    manifest = json.loads((out2 / "manifest.json").read_text())
    assert manifest["shards"][0]["url"] == "https://example.org/data/shard-00000.tpf"
    r = RecordReader(out2 / "shard-00000.tpf")
    assert len(r) == 2
    check_record(r[0], [a for a in atoms if a["chain"] == "A"], "1TST_A", 2.1)
    check_record(r[1], [a for a in atoms if a["chain"] == "B"], "1TST_B", 2.1)

    capsys.readouterr()
    assert tpf_main(["inspect", str(out2 / "shard-00000.tpf")]) == 0
    text = capsys.readouterr().out
    for expected in ("generation  2", "records     2", "positions: float32 [", "lz4", "chain_id: bytes1",
                     "<- current"):
        assert expected in text, text


def test_pack_extxyz(tmp_path, seed):
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    rng = np.random.default_rng(seed)
    frames = []
    for k in range(5):
        n = int(rng.integers(1, 20))
        a = Atoms(numbers=rng.integers(1, 30, n), positions=rng.uniform(-5, 5, (n, 3)),
                  cell=np.diag(rng.uniform(5, 10, 3)), pbc=True)
        a.calc = SinglePointCalculator(a, energy=float(rng.standard_normal()),
                                       forces=rng.standard_normal((n, 3)))
        frames.append(a)
    path = tmp_path / "frames.extxyz"
    write(path, frames, format="extxyz")
    out = tmp_path / "out"
    assert tpf_main(["pack", str(path), "-o", str(out), "--quiet", "--positions-dtype", "float64"]) == 0
    r = RecordReader(out / "shard-00000.tpf")
    assert len(r) == 5
    for k, a in enumerate(frames):
        rec = r[k]
        assert rec["identifier"] == f"frames:{k}"
        assert np.allclose(rec["positions"], a.positions, rtol=0, atol=1e-7)
        assert list(rec["atomic_numbers"]) == list(a.numbers)
        assert np.allclose(rec["energy"], a.get_potential_energy(), rtol=1e-12)
        assert np.allclose(rec["forces"], a.get_forces(), rtol=0, atol=1e-7)
        assert np.allclose(rec["cell"], a.cell[:], rtol=0, atol=1e-7)


def test_pack_and_inspect_errors(tmp_path, capsys):
    assert tpf_main(["pack", str(tmp_path / "missing.pdb"), "-o", str(tmp_path / "o"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hi")
    assert tpf_main(["pack", str(tmp_path / "notes.txt"), "-o", str(tmp_path / "o"), "--quiet"]) == 2
    assert "is not mmCIF/PDB" in capsys.readouterr().err
    (tmp_path / "bad.tpf").write_bytes(b"x" * 200)
    assert tpf_main(["inspect", str(tmp_path / "bad.tpf")]) == 1
    assert "not a TurboPairFormer store" in capsys.readouterr().out


def test_cli_entry_point_runs_as_a_module(tmp_path):
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "tpfkit.cli", "inspect", "--help"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "store file" in result.stdout
