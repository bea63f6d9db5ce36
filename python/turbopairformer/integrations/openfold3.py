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
ours: our ops take every N; only 16-bit inputs whose head dim is not a multiple of 8 up to 128 (our
CUDA kernels') go to PyTorch. The triangle multiplication keeps OpenFold3's rule that its kernel
path takes pair widths that are multiples of 32. The single track (AttentionPairBias, transitions)
runs as OpenFold3 runs it.
"""
from __future__ import annotations

import torch

from turbopairformer.integrations._patching import Integration, replace
from turbopairformer.ops.attention import triangle_attention
from turbopairformer.ops.trimul import triangle_multiplicative_update

__all__ = ["enable", "disable", "enabled", "disabled", "is_enabled"]


def _would_fall_back(n_token: int, hidden_dim: int, dtype: torch.dtype) -> bool:
    """OpenFold3's question 'would the kernel fall back to PyTorch?', answered for our ops."""
    return dtype in (torch.bfloat16, torch.float16) and (hidden_dim % 8 != 0 or hidden_dim > 128)


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
        it.forcing(blocks.PairBlock, "tri_att_start_end", use_cueq_triangle_kernels=True,
                   use_lma=False),
        # _cueq_triangle_mult raises for other pair widths; those keep OpenFold3's PyTorch path.
        it.forcing(blocks.PairBlock, "tri_mul_out_in", use_cueq_triangle_kernels=True,
                   when=_pair_width_of_32s),
    ]


_integration = Integration("openfold3", ("openfold3",), "openfold3 0.5.0", _plan)
enable = _integration.enable
disable = _integration.disable
enabled = _integration.enabled
disabled = _integration.disabled
is_enabled = _integration.is_enabled
