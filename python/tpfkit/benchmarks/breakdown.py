"""Where one training step's time goes, by component (issue 30): one step (forward + backward)
under torch.profiler, every kernel (CUDA) or op (CPU) put in one of CLASSES by its name.

On CUDA the profiler's kernel, memcpy and memset times are classified (device time: what the GPU
spent; the step's time outside them is launch gaps and host time). On the CPU, where there are no
kernels, each op's self CPU time is: the profiler sees our C++ entry points through the ranges
`labelled_native_calls` opens around them (tpfkit::<entry point>), so they are classified
as ours there too. The CPU form is for testing the machinery; its times carry the profiler's own
overhead per op.

CLASSES is the one table of names: (class, regex), the first match wins, searched in the kernel's
(demangled) name or the op's. A name that no pattern matches goes to "other_pytorch" and is
counted as unknown: `unknown_top` lists the largest, to refine the table with.
"""
from __future__ import annotations

import contextlib
import functools
import re
import time
import warnings
from typing import Callable, Iterable

import torch
from torch.autograd import DeviceType

# ---- the classification table ----------------------------------------------------------------
# (class, regex over kernel names on CUDA and op names on the CPU); first match wins. A class may
# have several rows: PyTorch's attention kernels (their names carry CUTLASS types) are matched
# before the GEMM row, the rest of PyTorch after it. The names were checked against the kernels
# the libraries hold (tests/python/test_breakdown_names.py: cuEquivariance 0.13's libcue_ops.so,
# its torch extension's kernels and prebuilt CuTe DSL cubins, its Triton sources; PyTorch's
# libtorch_cuda.so; cuBLAS(Lt)): how to list them again is in that test's docstring.
CLASSES: tuple[tuple[str, str], ...] = (
    # Ours (src/kernels/attention): forward, backward, its delta and the bias passes.
    ("ours_attention", r"attention_forward_sm90|attention_backward_sm90|attention_delta"
                       r"|bias_prepass|attention_dbias_finish|attention_dq_finish"
                       r"|^tpfkit::attention_"),
    # Ours (src/kernels/trimul): input/output-side forward and backward kernels, weight packing,
    # the column sums and the backward's finish (its cuBLAS calls are GEMMs, below).
    ("ours_trimul", r"(?<![A-Za-z])(input|output)_(forward|backward)\w*_kernel|pack_weights_kernel"
                    r"|reduce_sums_kernel|finish_backward_kernel|^tpfkit::trimul_"),
    # Ours (src/kernels/glue, tpfkit.ops.glue): LayerNorm, SwiGLU, the gated output.
    ("ours_glue", r"layer_norm_(forward|backward|finish)_kernel|swiglu_kernel|gated_output_kernel"
                   r"|^tpfkit::(layer_norm|swiglu|gated_output)"),
    # cuEquivariance (cuequivariance_ops 0.13), before the GEMM row (its kernels' names say gemm,
    # cutlass). Its CUDA kernels: libcue_ops.so's kernelcatcher:: and the torch extension's
    # cueq:: (the sm90 trimul kernels cueq::kf_zhifan_sm90::...). Triangle attention: its own,
    # statically linked cuDNN-derived FMHA (cudnn_fmha:: in the name or in the arguments, and a
    # few extern "C" kernels; the namespaces match their mangled names too, should the profiler
    # not demangle one). Trimul: its prebuilt CuTe DSL cubins (kernel_cutlass_<function>_...,
    # one hashed kf<hex digest>___...), its Triton kernels (by function name), its torch ops.
    ("cuequivariance", r"kernelcatcher|\bcueq::|_ZN4cueq|cuequivariance"
                       r"|cudnn_fmha|^(void )?(cudnn_sm\d+_[fb]prop_(sdpa|fmha)"
                       r"|native_sm\d+_fprop_fmha)|^compute_dot_do_o$"
                       r"|^kernel_cutlass_|^kf[0-9a-f]{32,}_"
                       r"|^(fused_sigmoid_gated_dual_gemm|layer_norm_transpose|trimul_ln1_vjp"
                       r"|pairformer_join_norm_gate|pair_repr_to_attention_bias)\w*_kernel"
                       r"|^_(attn_fwd_save(_fused_gate)?|attn_dq_dbias_native|attn_dkdv_native"
                       r"|pair_bias_only_fwd(_persist)?|pair_update_finalize_masked_bias|pair_bwd"
                       r"|pair_sufficient_stats_finalize|reduce_rows2|grad_wbias_reduce_gen"
                       r"|gate_bwd_delta_gen|dout_gate_bwd_delta|gate_vjp_producer"
                       r"|sm120_projection|matmul"
                       r"|pair_repr_to_attention_bias_prepare_affine_weights)_kernel"),
    # PyTorch's attention (scaled_dot_product_attention: flash, memory-efficient, cuDNN), before
    # the GEMM row: their names carry cutlass:: types.
    ("other_pytorch", r"\bpytorch_flash::|\bfmha_cutlass[FB]_|PyTorchMemEffAttention"
                      r"|cudnn_generated_fort_native_sdpa"),
    # cuBLAS / cuBLASLt / CUTLASS GEMMs (PyTorch's matmuls and our trimul's contraction); the
    # CPU's matmul ops. (Not fbgemm: PyTorch's jagged-tensor kernels are named after it.)
    ("gemm", r"(?<!fb)gemm|gemv|nvjet|cutlass|xmma|splitKreduce|cublas"
             r"|^aten::(mm|addmm|bmm|baddbmm|addbmm|_addmm_activation"
             r"|_?mkldnn_\w*(matmul|linear))$"),
    # PyTorch's other kernels and ops, known as such: elementwise, reductions, copies, softmax
    # (softmax_warp_* sit outside at::), LayerNorm, dropout, indexing, cub/thrust, the autograd
    # engine's own ops; Inductor's Triton kernels (triton_*); on the CPU also the records of
    # autograd Functions' forwards (ours: Eager, ops/_common.py's eager_autograd route of every op:
    # the host time around our calls).
    # TriFast's Triton kernels (_fwd, _bwd_kv, _bwd_q, _bwd_b; no client path here runs it) are
    # named here too, as other.
    ("other_pytorch", r"at::|c10::|^aten::|^autograd::|^torch::autograd::|Backward\d*$"
                      r"|AccumulateGrad|^detach_?$|^\w*Eager$|^Memcpy|^Memset|elementwise"
                      r"|reduce_kernel|cunn_|cudnn|^triton_|softmax_warp_(forward|backward)"
                      r"|indexing_backward_kernel|\bat_cuda_detail::|\bthrust::"
                      r"|^_(fwd|bwd_kv|bwd_q|bwd_b)$"),
)
OTHER = "other_pytorch"  # where a name no pattern matches goes (counted as unknown)
# The classes in the order of the tables and the plot's stacked bars.
NAMES = ("cuequivariance", "ours_attention", "ours_trimul", "ours_glue", "gemm", OTHER)
LABELS = {"ours_attention": "our attention", "ours_trimul": "our trimul",
          "ours_glue": "our glue", "gemm": "cuBLAS/GEMM", "cuequivariance": "cuEquivariance",
          OTHER: "other PyTorch"}
assert set(NAMES) == set(c for c, _ in CLASSES) == set(LABELS)
_PATTERNS = tuple((c, re.compile(p)) for c, p in CLASSES)
UNKNOWN_TOP = 10


@functools.lru_cache(maxsize=4096)
def classify(name: str) -> tuple[str, bool]:
    """(class, whether a pattern matched) of a kernel or op name."""
    for cls, pattern in _PATTERNS:
        if pattern.search(name):
            return cls, True
    return OTHER, False


# ---- profiling one step --------------------------------------------------------------------------

@contextlib.contextmanager
def labelled_native_calls():
    """Every call into tpfkit._C made by our ops inside a profiler range named
    tpfkit::<entry point> (on the CPU they run no kernel the profiler would name)."""
    from tpfkit.ops import _common, attention, glue, trimul

    original = _common.native

    def native(fn, *args):
        with torch.profiler.record_function(f"tpfkit::{getattr(fn, '__name__', fn)}"):
            return original(fn, *args)

    modules = [m for m in (attention, glue, trimul) if getattr(m, "native", None) is original]
    for m in modules:
        m.native = native
    try:
        yield
    finally:
        for m in modules:
            m.native = original


def profile_step(step: Callable[[], None], device: torch.device,
                 step_ms: float | None = None) -> dict:
    """Runs step() once (warm: call it after the warm-up steps) under torch.profiler and returns
    the breakdown of its time (`breakdown`); step_ms: the unprofiled step's time, for the shares
    of the step."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with labelled_native_calls(), torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            wall_ms = (time.perf_counter() - t0) * 1e3
    result = breakdown(prof.events(), cuda, step_ms)
    result["profiled_step_wall_ms"] = wall_ms
    return result


def breakdown(events: Iterable, cuda: bool, step_ms: float | None = None) -> dict:
    """The profiler's events of one step by class.

    classes[c]: ms, share (of the profiled total), share_of_step (of max(step_ms, total): with
    `outside_ms` they add up to 1), count. total_ms: on CUDA the sum of the kernel, memcpy and
    memset times; on the CPU the time inside the top-level ops (the self times of all ops add up
    to it). outside_ms: step_ms less the total (CUDA: the GPU idle in the step; at least 0).
    unknown_top: the largest names no pattern matched (in other_pytorch), [name, ms, count].
    """
    events = list(events)
    if cuda:
        # Not the GPU-timeline copies of the record_function ranges (ours included): they span
        # kernels counted already.
        ranges = {e.name for e in events
                  if e.device_type == DeviceType.CPU and getattr(e, "is_user_annotation", False)}
        items = [(e.name, e.time_range.elapsed_us()) for e in events
                 if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                 and e.name not in ranges]
        total_us = sum(us for _, us in items)
        source = "CUDA kernels, memcpy and memset (profiler device time)"
    else:
        ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
        items = [(e.name, e.self_cpu_time_total) for e in ops]
        total_us = sum(e.cpu_time_total for e in ops if e.cpu_parent is None)
        source = "CPU ops (profiler self CPU time)"
    per_class = {c: [0.0, 0] for c in NAMES}
    unknown: dict[str, list] = {}
    for name, us in items:
        cls, known = classify(name)
        per_class[cls][0] += us
        per_class[cls][1] += 1
        if not known:
            entry = unknown.setdefault(name, [0.0, 0])
            entry[0] += us
            entry[1] += 1
    total_ms = total_us / 1e3
    whole = max(step_ms or 0.0, total_ms)
    classes = {c: {"ms": us / 1e3, "share": us / 1e3 / total_ms if total_ms else 0.0,
                   "share_of_step": us / 1e3 / whole if whole else 0.0, "count": n}
               for c, (us, n) in per_class.items()}
    top = sorted(unknown.items(), key=lambda kv: -kv[1][0])[:UNKNOWN_TOP]
    return {"source": source, "total_ms": total_ms, "step_ms": step_ms,
            "outside_ms": max(0.0, (step_ms or 0.0) - total_ms), "classes": classes,
            "unknown_ms": sum(v[0] for v in unknown.values()) / 1e3,
            "unknown_top": [[name[:300], us / 1e3, n] for name, (us, n) in top]}


# ---- reporting -----------------------------------------------------------------------------------

SHORT = {"ours_attention": "attn", "ours_trimul": "trimul", "ours_glue": "glue", "gemm": "GEMM",
         "cuequivariance": "cuEq", OTHER: "other"}


def table(rows: list[dict], keys=("client", "N", "path")) -> list[str]:
    """One line per row with a breakdown: ms (share of the step) per class, the profiled total,
    the step and the time outside the profiled kernels/ops."""
    head = (f"{'client':9s} {'N':>5s} {'path':14s} " + " ".join(f"{SHORT[c]:>14s}" for c in NAMES)
            + f" {'profiled':>9s} {'step':>9s} {'outside':>9s}")
    lines = [head]
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        cells = " ".join(f"{b['classes'][c]['ms']:7.2f} "
                         f"({100 * b['classes'][c]['share_of_step']:3.0f}%)" for c in NAMES)
        step = b["step_ms"] if b["step_ms"] is not None else float("nan")
        lines.append(f"{str(r.get(keys[0], '')):9s} {r.get(keys[1], 0):5d} "
                     f"{str(r.get(keys[2], '')):14s} {cells} {b['total_ms']:9.2f} {step:9.2f} "
                     f"{b['outside_ms']:9.2f}")
    return lines


def unknown_top(rows: list[dict], n: int = UNKNOWN_TOP) -> list[tuple[str, float, int]]:
    """The names no pattern matched, summed over the rows, largest first."""
    total: dict[str, list] = {}
    for r in rows:
        for name, ms, count in (r.get("breakdown") or {}).get("unknown_top", []):
            entry = total.setdefault(name, [0.0, 0])
            entry[0] += ms
            entry[1] += count
    return [(name, ms, c) for name, (ms, c) in sorted(total.items(), key=lambda kv: -kv[1][0])[:n]]


COLORS = {"ours_attention": "tab:red", "ours_trimul": "tab:orange", "ours_glue": "tab:olive",
          "gemm": "tab:blue", "cuequivariance": "tab:green", OTHER: "tab:gray"}


def plot_bars(ax, rows: list[dict]) -> None:
    """Stacked bars, one per row (N, path) with a breakdown: ms per class and the time outside."""
    rows = [r for r in rows if r.get("breakdown")]
    xs = range(len(rows))
    bottom = [0.0] * len(rows)
    for c in NAMES + ("outside",):
        heights = [r["breakdown"]["outside_ms"] if c == "outside"
                   else r["breakdown"]["classes"][c]["ms"] for r in rows]
        ax.bar(xs, heights, bottom=bottom, color=COLORS.get(c, "white"),
               edgecolor="black" if c == "outside" else None, linewidth=0.3,
               label=LABELS.get(c, "outside kernels"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(list(xs))
    short = {"pytorch": "torch", "cuequivariance": "cueq"}
    ax.set_xticklabels([f"{r['N']}\n{short.get(r['path'], r['path'])}" for r in rows], fontsize=7)
    ax.set_xlabel("N, path")
    ax.set_ylabel("step (ms): profiled components + outside")
