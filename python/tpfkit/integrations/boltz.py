"""Our triangle attention and triangle multiplication inside Boltz's models (boltz 2.2.1 and
boltz-community 2.12.0, which install the same `boltz` package).

    from tpfkit.integrations import boltz as tpf_boltz
    tpf_boltz.enable()               # every Boltz model, built before or after, runs our ops
    with tpf_boltz.enabled(): ...    # or for a block only

Boltz calls cuEquivariance from `kernel_triangular_attn` and `kernel_triangular_mult`, on its
layers' `use_kernels=True` path; enable() puts ours in their place and makes the triangle layers take
that path whatever `use_kernels` says (Boltz 1 and 2, the PairFormer, the MSA and template modules).
Boltz hands q, k, v as strided [B, I, H, J, D] views, a bool mask [B, I, 1, 1, J] and, under bf16
autocast, the triangle multiplication a float32 pair with float32 weights: our ops take all of these
as cuEquivariance does (that last one in the autocast dtype). boltz-community remembers a failed
kernel call and then stays on PyTorch; enable() starts it with a clean record (disable() restores
the old one). Inputs our ops do not take (float64, say, or on CUDA a head dim our kernels do not
cover: _patching.attention_takes and trimul_takes) run the layers' PyTorch path (`use_kernels=False`).

The glue around the triangle attention and the transitions runs fused on Boltz's own modules and
parameters (tpfkit.nn.functional, the same code as our nn modules): a TriangleAttention
runs one fused LayerNorm, its q, k, v, gate and pair-bias projections as one GEMM, our attention,
the gate fused with the heads' re-layout and the output projection; a Transition (the SwiGLU MLP,
pair and single track) a fused LayerNorm, one GEMM for fc1 and fc2, our SwiGLU and fc3. The
dropout stays where Boltz applies it, on the modules' outputs. Inputs the glue does not take
(_patching.glue_takes) run Boltz's forwards, as does a Transition chunked for inference. The single
track's attention (AttentionPairBias) runs as Boltz runs it.
"""
from __future__ import annotations

from tpfkit.integrations._patching import (Fallback, Integration, attention_takes,
                                                    fused_triangle_attention, glue_takes,
                                                    plain_linears, replace,
                                                    triangle_attention_takes, trimul_takes)
from tpfkit.nn import functional as F
from tpfkit.ops.attention import triangle_attention
from tpfkit.ops.trimul import triangle_multiplicative_update

__all__ = ["enable", "disable", "enabled", "disabled", "is_enabled"]


def _kernel_triangular_attn(q, k, v, tri_bias, mask, scale):
    """Boltz's kernel_triangular_attn, on our op."""
    return triangle_attention(q, k, v, tri_bias, mask=mask, scale=scale)


# A triangle layer given inputs our ops do not take runs Boltz's PyTorch path.
_ATTENTION_FALLBACK = Fallback(("x",), lambda layer, x: attention_takes(x, layer.mha.c_hidden, layer),
                               {"use_kernels": False})
_TRIMUL_FALLBACK = Fallback(("x",), lambda layer, x: trimul_takes(x), {"use_kernels": False})


def _core(q, k, v, bias, mask):
    return triangle_attention(q, k, v, bias, mask)


def _triangle_attention_forward(self, x, mask=None, chunk_size=None, use_kernels=False):
    """TriangleAttention.forward fused (functional.triangle_attention_update), as its kernel path
    runs it (unchunked, whatever chunk_size says); NotImplemented for inputs our ops do not take."""
    if not triangle_attention_takes(self, x):
        return NotImplemented
    keep = None if mask is None else mask.bool()  # as Boltz hands its mask to the kernel
    return fused_triangle_attention(self, x, keep, self.linear, _core)


def _transition_forward(self, x, chunk_size=None):
    """Transition.forward (the SwiGLU MLP of the pair and single tracks) fused
    (functional.swiglu_transition); NotImplemented where Boltz chunks it (inference with a
    chunk size) and for inputs our glue does not take."""
    if (chunk_size is not None and not self.training) or not (
            glue_takes(x) and plain_linears(self.fc1, self.fc2, self.fc3)):
        return NotImplemented
    return F.swiglu_transition(x, norm=self.norm, a=self.fc1, b=self.fc2, out=self.fc3,
                               fused=F.fusable())


def _calls_kernel(it: Integration, module, function, kernel: str) -> None:
    """function calls kernel, or (boltz-community) the module's _kernel_or_none, which does."""
    wrapper = vars(module).get("_kernel_or_none")
    if wrapper is not None and "_kernel_or_none" in function.__code__.co_names:
        it.calls(wrapper, kernel)
    else:
        it.calls(function, kernel)


def _plan(it: Integration):
    primitives = it.module("boltz.model.layers.triangular_attention.primitives")
    attention = it.module("boltz.model.layers.triangular_attention.attention")
    trimul = it.module("boltz.model.layers.triangular_mult")
    transition = it.module("boltz.model.layers.transition")
    it.attribute(primitives, "kernel_triangular_attn")
    it.attribute(trimul, "kernel_triangular_mult")
    _calls_kernel(it, primitives, it.attribute(primitives.Attention, "forward"),
                  "kernel_triangular_attn")
    changes = [
        replace(primitives, "kernel_triangular_attn", _kernel_triangular_attn),
        replace(trimul, "kernel_triangular_mult", triangle_multiplicative_update),
        # boltz-community's use_flash_attn (PyTorch's SDPA) yields to the kernel path.
        it.fusing(attention.TriangleAttention, "forward", _triangle_attention_forward,
                  base=it.forcing(attention.TriangleAttention, "forward",
                                  fallback=_ATTENTION_FALLBACK, use_kernels=True),
                  ignoring=("use_flash_attn",)),
        it.fusing(it.attribute(transition, "Transition"), "forward", _transition_forward),
    ]
    for name in ("TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming"):
        layer = it.attribute(trimul, name)
        _calls_kernel(it, trimul, it.attribute(layer, "forward"), "kernel_triangular_mult")
        changes.append(it.forcing(layer, "forward", fallback=_TRIMUL_FALLBACK, use_kernels=True))
    for module in (primitives, trimul):
        if isinstance(vars(module).get("_kernel_failure"), dict):
            changes.append(replace(module, "_kernel_failure", {"reason": None}))
    return changes


_integration = Integration("boltz", ("boltz", "boltz-community"),
                           "boltz 2.2.1 and boltz-community 2.12.0", _plan)
enable, disable, enabled, disabled, is_enabled = _integration.functions()
