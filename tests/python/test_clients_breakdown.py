"""bench/clients.py --breakdown on the CPU (issue 30): the classification table against our
kernels' names in src/kernels and representative library names, and one client stack (Boltz's,
small widths, N = 16) profiled on its PyTorch path and ours: every class's time is in the JSON
rows, the classes add up to the profiled total, ours show where they run and only there, and
the table and the plot's bars are written. No timings are asserted."""
from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest

from tpfkit.benchmarks import breakdown

ROOT = Path(__file__).resolve().parents[2]
KERNEL_CLASS = {"attention": "ours_attention", "trimul": "ours_trimul", "glue": "ours_glue"}


def our_kernels() -> list[tuple[str, str]]:
    """(folder under src/kernels, name) of every __global__ function there."""
    found = []
    for path in sorted((ROOT / "src" / "kernels").rglob("*.cu*")):
        text = path.read_text()
        for name in re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(",
                               text):
            found.append((path.parent.name, name))
    return found


def test_every_kernel_of_ours_is_in_its_class():
    kernels = our_kernels()
    assert len(kernels) >= 15, kernels
    for folder, name in kernels:
        demangled = f"void tpf::cuda::x::(anonymous namespace)::{name}<__nv_bfloat16, 64>(Params)"
        assert breakdown.classify(demangled) == (KERNEL_CLASS[folder], True), (folder, name)


@pytest.mark.parametrize("name, cls, known", [
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTT", "gemm", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm",
     True),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
     "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)", "gemm", True),
    ("aten::addmm", "gemm", True),
    ("fused_sigmoid_gated_dual_gemm_forward_kernel", "cuequivariance", True),
    ("layer_norm_transpose_backward_kernel", "cuequivariance", True),
    ("void cudnn_fmha::fwd::fp16::cudnn_sm80_fprop_sdpa_fp16_64x64xD<false, 32>"
     "(cudnn_fmha::AttentionDescriptor, cudnn_fmha::strides_t)", "cuequivariance", True),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"
     "(int, float, c10::BFloat16 const*, c10::BFloat16 const*)", "other_pytorch", True),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"
     "(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)", "other_pytorch", True),
    ("Memcpy DtoD (Device -> Device)", "other_pytorch", True),
    ("tpfkit::attention_backward", "ours_attention", True),
    ("tpfkit::trimul_forward", "ours_trimul", True),
    ("tpfkit::swiglu", "ours_glue", True),
    ("some_kernel_nobody_named", "other_pytorch", False),
])
def test_classify(name, cls, known):
    assert breakdown.classify(name) == (cls, known)


@pytest.fixture(scope="module")
def bench():
    """bench/clients.py's program (`tpf bench clients-gpu`), called with an argument list."""
    from tpfkit.benchmarks.cli import script_main
    return types.SimpleNamespace(main=lambda argv: script_main("clients-gpu", argv))


def check_breakdown(row: dict) -> dict:
    b = row["breakdown"]
    for key in ("source", "total_ms", "step_ms", "outside_ms", "classes", "unknown_ms",
                "unknown_top", "profiled_step_wall_ms"):
        assert key in b, key
    assert set(b["classes"]) == set(breakdown.NAMES)
    for c in b["classes"].values():
        assert set(c) == {"ms", "share", "share_of_step", "count"}
        assert c["ms"] >= 0
    ms = {c: v["ms"] for c, v in b["classes"].items()}
    assert b["total_ms"] > 0
    # The classes (self times) add up to the profiled total (the top-level ops' times).
    assert sum(ms.values()) == pytest.approx(b["total_ms"], rel=0.01, abs=0.05)
    assert sum(v["share"] for v in b["classes"].values()) == pytest.approx(1, abs=0.01)
    whole = max(b["step_ms"], b["total_ms"])
    assert (sum(v["share_of_step"] for v in b["classes"].values()) + b["outside_ms"] / whole
            == pytest.approx(1, abs=0.01))
    assert b["step_ms"] == row["step_ms"] and b["outside_ms"] >= 0
    assert ms["gemm"] > 0 and ms["other_pytorch"] > 0 and ms["cuequivariance"] == 0
    return ms


def test_breakdown_of_a_client_stack(bench, tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "rows.png"
    assert bench.main(["--device", "cpu", "--config", "small", "--clients", "boltz",
                       "--sizes", "16", "--paths", "pytorch", "ours", "--steps", "1",
                       "--warmup", "1", "--breakdown", "--json", str(out),
                       "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["breakdown_classes"] == [list(row) for row in breakdown.CLASSES]
    rows = {r["path"]: r for r in data["rows"] if r["status"] == "ok"}
    assert set(rows) == {"pytorch", "ours"}
    ours, torch_path = check_breakdown(rows["ours"]), check_breakdown(rows["pytorch"])
    assert ours["ours_attention"] > 0 and ours["ours_trimul"] > 0 and ours["ours_glue"] > 0
    assert torch_path["ours_attention"] == torch_path["ours_trimul"] == 0
    assert torch_path["ours_glue"] == 0
    printed = capsys.readouterr().out
    assert "breakdown of one profiled step" in printed and "largest names no pattern" in printed
    assert png.stat().st_size > 0


def test_breakdown_of_a_module(bench, tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--config", "small", "--clients", "boltz",
                       "--module", "pair_transition", "--sizes", "16", "--paths", "ours",
                       "--steps", "1", "--warmup", "1", "--breakdown", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert check_breakdown(row)["ours_glue"] > 0


def test_no_breakdown_unless_asked(bench, tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--config", "small", "--clients", "boltz",
                       "--module", "pair_transition", "--sizes", "8", "--paths", "ours",
                       "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["breakdown_classes"] is None
    assert all("breakdown" not in r for r in data["rows"])
