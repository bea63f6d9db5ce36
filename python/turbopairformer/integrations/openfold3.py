"""Our triangle attention and triangle multiplication inside OpenFold3's models (openfold3 0.5.0).

    from turbopairformer.integrations import openfold3 as tpf_of3
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
multiples of 32. The single track (AttentionPairBias, transitions) runs as OpenFold3 runs it.
"""
from __future__ import annotations

import torch

from turbopairformer.integrations._patching import (Fallback, Integration, attention_takes,
                                                    replace, trimul_takes)
from turbopairformer.ops.attention import triangle_attention
from turbopairformer.ops.trimul import triangle_multiplicative_update

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


def _pair_width_of_32s(self, z, *args, **kwargs) -> bool:
    return z.shape[-1] % 32 == 0


def _plan(it: Integration):
    attention = it.module("openfold3.core.model.primitives.attention")
    trimul = it.module("openfold3.core.model.layers.triangular_multiplicative_update")
    blocks = it.module("openfold3.core.model.latent.base_blocks")
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
    ]


_integration = Integration("openfold3", ("openfold3",), "openfold3 0.5.0", _plan)
enable = _integration.enable
disable = _integration.disable
enabled = _integration.enabled
disabled = _integration.disabled
is_enabled = _integration.is_enabled
