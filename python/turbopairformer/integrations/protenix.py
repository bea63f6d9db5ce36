"""Our triangle attention and triangle multiplication inside Protenix's models (protenix 2.0.0).

    from turbopairformer.integrations import protenix as tpf_protenix
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
dim our kernels do not cover: _patching.attention_takes and trimul_takes). The single track (AttentionPairBias, transitions) runs as Protenix
runs it.
"""
from __future__ import annotations

from turbopairformer.integrations._patching import (Fallback, Integration, attention_takes,
                                                    replace, trimul_takes)
from turbopairformer.ops.attention import triangle_attention
from turbopairformer.ops.trimul import triangle_multiplicative_update

__all__ = ["enable", "disable", "enabled", "disabled", "is_enabled"]

_KERNEL = "cuequivariance"
# A triangle layer given inputs our ops do not take runs Protenix's PyTorch path.
_ATTENTION_FALLBACK = Fallback(("x",), lambda layer, x: attention_takes(x, layer.mha.c_hidden, layer),
                               {"triangle_attention": "torch"})
_TRIMUL_FALLBACK = Fallback(("z",), lambda layer, z: trimul_takes(z),
                            {"triangle_multiplicative": "torch"})


def _plan(it: Integration):
    layers = it.module("protenix.model.triangular.layers")
    triangular = it.module("protenix.model.triangular.triangular")
    it.attribute(layers, "cuequivariance_triangular_attn")
    it.attribute(triangular, "kernel_triangular_mult")
    it.calls(it.attribute(layers.Attention, "forward"), "cuequivariance_triangular_attn")
    update = it.attribute(triangular, "TriangleMultiplicativeUpdate")
    it.calls(it.attribute(update, "forward"), "kernel_triangular_mult")
    return [
        # Protenix calls it as (q, k, v, bias, mask, scale): our op's own order.
        replace(layers, "cuequivariance_triangular_attn", triangle_attention),
        replace(triangular, "kernel_triangular_mult", triangle_multiplicative_update),
        it.forcing(update, "forward", fallback=_TRIMUL_FALLBACK, triangle_multiplicative=_KERNEL),
        it.forcing(triangular.TriangleAttention, "forward", fallback=_ATTENTION_FALLBACK,
                   triangle_attention=_KERNEL),
    ]


_integration = Integration("protenix", ("protenix",), "protenix 2.0.0", _plan)
enable = _integration.enable
disable = _integration.disable
enabled = _integration.enabled
disabled = _integration.disabled
is_enabled = _integration.is_enabled
