"""Our triangle attention and triangle multiplication inside OpenFold3's models (openfold3 0.5.0).

    from tpfkit.integrations import openfold3 as tpf_of3
    tpf_of3.enable()                 # every OpenFold3 model, built before or after, runs our ops
    with tpf_of3.enabled(): ...      # or for a block only

OpenFold3 calls cuEquivariance from two functions, `_cueq_triangle_attn` and `_cueq_triangle_mult`,
through names it binds at import (and only where cuEquivariance and a GPU are present); enable()
binds ours there, and makes the pair stacks (PairBlock, shared by the PairFormer, the template and
the MSA module) take that path whatever `use_cueq_triangle_kernels` says: OpenFold3's own handling of
that flag then keeps its in-place and chunked inference paths right. Its guard that sends
N <= 100 tokens (cuEquivariance's threshold) and unsupported head dims to PyTorch is replaced by
ours: our ops take every N; inputs they do not take (float64, say, or on CUDA a head dim our
kernels do not cover: _patching.attention_takes and trimul_takes) run OpenFold3's PyTorch path, as
the pair stack's caller asked for it (`use_cueq_triangle_kernels=False`, its other arguments as
given), and so does an Attention called with `use_cueq_triangle_kernels=True` directly. The
triangle multiplication keeps OpenFold3's rule that its kernel path takes pair widths that are
multiples of 32.

The glue around the triangle attention and the SwiGLU transitions runs fused on OpenFold3's own
modules and parameters (tpfkit.nn.functional, the same code as our nn modules): a
TriangleAttention asked for the kernel path unchunked runs one fused LayerNorm, its q, k, v, gate
and pair-bias projections as one GEMM, our attention, the gate fused with the heads' re-layout and
the output projection; SwiGLUTransition._transition (each chunk, where OpenFold3 chunks) runs a
fused LayerNorm, one GEMM for both SwiGLU projections, our SwiGLU and the output projection. The
pair stack's dropout stays where OpenFold3 applies it, on the modules' outputs. Inputs the glue
does not take (_patching.glue_takes) and the other paths (chunked, LMA, Triton) run OpenFold3's
forwards. The single track's attention (AttentionPairBias) runs as OpenFold3 runs it.
"""
from __future__ import annotations

import torch

from tpfkit.integrations._patching import (Fallback, Integration, attention_takes,
                                                    fused_triangle_attention, glue_takes,
                                                    plain_linears, replace,
                                                    triangle_attention_takes, trimul_takes)
from tpfkit.nn import functional as F
from tpfkit.ops.attention import triangle_attention
from tpfkit.ops.trimul import triangle_multiplicative_update

__all__ = ["enable", "disable", "enabled", "disabled", "is_enabled"]


def _would_fall_back(n_token: int, hidden_dim: int, dtype: torch.dtype) -> bool:
    """OpenFold3's question 'would the kernel fall back to PyTorch?': no, since Attention.forward
    (below) has already turned the kernel switch off for inputs our ops do not take."""
    return False


_OFF = {"use_cueq_triangle_kernels": False}
# The pair stack's triangle layers, and any Attention, given inputs our ops do not take run
# OpenFold3's PyTorch path.
_PAIR_ATTENTION_FALLBACK = Fallback(
    ("z",), lambda block, z: attention_takes(z, block.tri_att_start.mha.c_hidden,
                                             block.tri_att_start), _OFF)
_PAIR_TRIMUL_FALLBACK = Fallback(("z",), lambda block, z: trimul_takes(z), _OFF)
_ATTENTION_FALLBACK = Fallback(
    ("q_x", "use_cueq_triangle_kernels"),
    lambda mha, q_x, kernels: not kernels or attention_takes(q_x, mha.c_hidden, mha), _OFF)


def _core(q, k, v, bias, mask):
    return triangle_attention(q, k, v, bias, mask)


def _triangle_attention_forward(self, x, mask=None, transpose_bias=False, chunk_size=None,
                                use_deepspeed_evo_attention=False, use_cueq_triangle_kernels=False,
                                use_triton_triangle_kernels=False, use_lma=False,
                                inplace_safe=False):
    """TriangleAttention.forward fused (functional.triangle_attention_update) where the kernel
    path is asked for (the pair stack asks for it, above) unchunked; otherwise NotImplemented."""
    if not (use_cueq_triangle_kernels and chunk_size is None and not use_lma and
            not use_triton_triangle_kernels and triangle_attention_takes(self, x)):
        return NotImplemented
    # OpenFold3 masks keys by a bias inf * (mask - 1): those where it is not 0.
    keep = None if mask is None else mask == 1
    return fused_triangle_attention(self, x, keep, self.linear_z, _core,
                                    transpose_bias=transpose_bias)


def _swiglu_transition(self, x, mask):
    """SwiGLUTransition._transition (each chunk's, where OpenFold3 chunks) fused
    (functional.swiglu_transition); NotImplemented for inputs our glue does not take."""
    swiglu = self.swiglu
    if not (glue_takes(x) and plain_linears(swiglu.linear_a, swiglu.linear_b, self.linear_out)):
        return NotImplemented
    return F.swiglu_transition(x, norm=self.layer_norm, a=swiglu.linear_a, b=swiglu.linear_b,
                               out=self.linear_out, fused=F.fusable()) * mask


def _pair_width_of_32s(self, z, *args, **kwargs) -> bool:
    return z.shape[-1] % 32 == 0


def _plan(it: Integration):
    attention = it.module("openfold3.core.model.primitives.attention")
    trimul = it.module("openfold3.core.model.layers.triangular_multiplicative_update")
    blocks = it.module("openfold3.core.model.latent.base_blocks")
    triangular = it.module("openfold3.core.model.layers.triangular_attention")
    transition = it.module("openfold3.core.model.layers.transition")
    it.attribute(attention, "cueq_is_installed")
    it.calls(it.attribute(attention, "_cueq_triangle_attn"), "triangle_attention")
    forward = it.attribute(it.attribute(attention, "Attention"), "forward")
    it.calls(forward, "cueq_is_installed")
    it.calls(forward, "cueq_would_fall_back")
    it.calls(it.attribute(trimul, "_cueq_triangle_mult"), "triangle_multiplicative_update")
    return [
        replace(attention, "cueq_is_installed", True),
        replace(attention, "cueq_would_fall_back", _would_fall_back),
        replace(attention, "triangle_attention", triangle_attention),
        replace(trimul, "triangle_multiplicative_update", triangle_multiplicative_update),
        it.forcing(attention.Attention, "forward", fallback=_ATTENTION_FALLBACK),
        it.forcing(blocks.PairBlock, "tri_att_start_end", fallback=_PAIR_ATTENTION_FALLBACK,
                   use_cueq_triangle_kernels=True, use_lma=False),
        # _cueq_triangle_mult raises for other pair widths; those keep OpenFold3's PyTorch path.
        it.forcing(blocks.PairBlock, "tri_mul_out_in", use_cueq_triangle_kernels=True,
                   when=_pair_width_of_32s, fallback=_PAIR_TRIMUL_FALLBACK),
        it.fusing(it.attribute(triangular, "TriangleAttention"), "forward",
                  _triangle_attention_forward),
        it.fusing(it.attribute(transition, "SwiGLUTransition"), "_transition", _swiglu_transition),
    ]


_integration = Integration("openfold3", ("openfold3",), "openfold3 0.5.0", _plan)
enable, disable, enabled, disabled, is_enabled = _integration.functions()
