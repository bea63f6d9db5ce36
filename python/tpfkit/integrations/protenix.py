"""Our triangle attention and triangle multiplication inside Protenix's models (protenix 2.0.0).

    from tpfkit.integrations import protenix as tpf_protenix
    tpf_protenix.enable()               # every Protenix model, built before or after, runs our ops
    with tpf_protenix.enabled(): ...    # or for a block only

Protenix calls cuEquivariance from `cuequivariance_triangular_attn` and `kernel_triangular_mult`
where its layers get `triangle_attention="cuequivariance"` / `triangle_multiplicative=
"cuequivariance"`; enable() puts our ops in their place and makes the triangle layers take that
path whatever the configuration says (the PairFormer, MSA, template and confidence stacks). Protenix
hands them cuEquivariance's B = 1 forms: q, k, v [N, H, S, D] with a float32 bias, of whose result
it takes [0], and x [1, S, S, D] with a mask [S, S]; our ops take these as they are. Its own guards
stay: sequences of at most 16 tokens and triangle multiplications whose hidden width is not the
pair width run its PyTorch path; so do inputs our ops do not take (float64, say, or on CUDA a head
dim our kernels do not cover: _patching.attention_takes and trimul_takes).

The glue around the triangle attention and the transitions runs fused on Protenix's own modules
and parameters (tpfkit.nn.functional, the same code as our nn modules): a
TriangleAttention on the kernel path, unchunked, runs one fused LayerNorm, its q, k, v, gate and
pair-bias projections as one GEMM, our attention, the gate fused with the heads' re-layout and the
output projection; a Transition (pair and single track) a fused LayerNorm, one GEMM for both SwiGLU
projections, our SwiGLU and the output projection. The row-wise dropout stays where Protenix
applies it, on the modules' outputs. Inputs the glue does not take (_patching.glue_takes) run
Protenix's forwards, as do its chunked paths. The single track's attention (AttentionPairBias)
runs as Protenix runs it.
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

_KERNEL = "cuequivariance"
# A triangle layer given inputs our ops do not take runs Protenix's PyTorch path.
_ATTENTION_FALLBACK = Fallback(("x",), lambda layer, x: attention_takes(x, layer.mha.c_hidden, layer),
                               {"triangle_attention": "torch"})
_TRIMUL_FALLBACK = Fallback(("z",), lambda layer, z: trimul_takes(z),
                            {"triangle_multiplicative": "torch"})


# Protenix's kernel path runs sequences of at most this many tokens on PyTorch, and its Transition
# chunks sequences of at least _TRANSITION_CHUNKED tokens in inference.
_TORCH_TOKENS = 16
_TRANSITION_CHUNKED = 3200


def _core(q, k, v, bias, mask):
    return triangle_attention(q, k, v, bias, mask)


def _triangle_attention_forward(self, x, mask=None, chunk_size=None, triangle_attention="torch",
                                inplace_safe=False):
    """TriangleAttention.forward fused (functional.triangle_attention_update) where it runs
    unchunked on the kernel path; NotImplemented otherwise (its guards, inputs our ops do not
    take)."""
    if not (chunk_size is None and triangle_attention_takes(self, x) and
            x.shape[-2] > _TORCH_TOKENS):
        return NotImplemented
    # Protenix masks keys by a bias inf * (mask - 1), and hands the kernel those where it is 0.
    keep = None if mask is None else mask == 1
    return fused_triangle_attention(self, x, keep, self.linear, _core)


def _transition_forward(self, x):
    """Transition.forward (AlphaFold3's SwiGLU transition, pair and single track) fused
    (functional.swiglu_transition); NotImplemented where Protenix chunks it (inference on
    _TRANSITION_CHUNKED tokens or more) and for inputs our glue does not take. In inference the
    result has x's dtype, as Protenix's."""
    layers = (self.linear_no_bias_a, self.linear_no_bias_b, self.linear_no_bias)
    if (not self.training and x.shape[-2] >= _TRANSITION_CHUNKED) or not (
            glue_takes(x) and plain_linears(*layers)):
        return NotImplemented
    out = F.swiglu_transition(x, norm=self.layernorm1, a=layers[0], b=layers[1], out=layers[2],
                              fused=F.fusable())
    return out if self.training else out.to(x.dtype)


def _plan(it: Integration):
    layers = it.module("protenix.model.triangular.layers")
    triangular = it.module("protenix.model.triangular.triangular")
    it.attribute(layers, "cuequivariance_triangular_attn")
    it.attribute(triangular, "kernel_triangular_mult")
    it.calls(it.attribute(layers.Attention, "forward"), "cuequivariance_triangular_attn")
    update = it.attribute(triangular, "TriangleMultiplicativeUpdate")
    primitives = it.module("protenix.model.modules.primitives")
    it.calls(it.attribute(update, "forward"), "kernel_triangular_mult")
    return [
        # Protenix calls it as (q, k, v, bias, mask, scale): our op's own order.
        replace(layers, "cuequivariance_triangular_attn", triangle_attention),
        replace(triangular, "kernel_triangular_mult", triangle_multiplicative_update),
        it.forcing(update, "forward", fallback=_TRIMUL_FALLBACK, triangle_multiplicative=_KERNEL),
        it.fusing(triangular.TriangleAttention, "forward", _triangle_attention_forward,
                  base=it.forcing(triangular.TriangleAttention, "forward",
                                  fallback=_ATTENTION_FALLBACK, triangle_attention=_KERNEL)),
        it.fusing(it.attribute(primitives, "Transition"), "forward", _transition_forward),
    ]


_integration = Integration("protenix", ("protenix",), "protenix 2.0.0", _plan)
enable, disable, enabled, disabled, is_enabled = _integration.functions()
