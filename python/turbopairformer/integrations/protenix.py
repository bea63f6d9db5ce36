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
pair width run its PyTorch path. The single track (AttentionPairBias, transitions) runs as Protenix
runs it.
"""
from __future__ import annotations

from turbopairformer.integrations._patching import Integration, replace
from turbopairformer.ops.attention import triangle_attention
from turbopairformer.ops.trimul import triangle_multiplicative_update

__all__ = ["enable", "disable", "enabled", "disabled", "is_enabled"]

_KERNEL = "cuequivariance"


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
        it.forcing(update, "forward", triangle_multiplicative=_KERNEL),
        it.forcing(triangular.TriangleAttention, "forward", triangle_attention=_KERNEL),
    ]


_integration = Integration("protenix", ("protenix",), "protenix 2.0.0", _plan)
enable = _integration.enable
disable = _integration.disable
enabled = _integration.enabled
disabled = _integration.disabled
is_enabled = _integration.is_enabled
