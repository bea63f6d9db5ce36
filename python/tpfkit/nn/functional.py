"""The glue around our big ops as functions of the layers that hold the parameters: the one
implementation that our nn modules (tpfkit.nn) and the client integrations
(tpfkit.integrations) both run, so a client's triangle attention and transition take the
same path as ours on the client's own nn.Modules (their parameters, state dicts and autograd
untouched: the concatenations below are inside the forward, so each parameter gets its gradient).

- `layer_norm`: a LayerNorm module's math in one kernel (tpfkit.ops.glue.layer_norm),
  writing the dtype the next GEMM casts to under autocast.
- `linears`: several linear layers applied to the same x in ONE GEMM over their concatenated
  weights (and biases where any has one): one read and one autocast cast of x, and its gradient
  summed inside the GEMM instead of one tensor per layer added up.
- `gated_attention`: q, k, v, gate [B, N, S, H*D] (column slices of one GEMM) -> the attention
  core -> sigmoid gate with the heads laid back into rows (ops.glue.gated_output) -> the output
  projection.
- `triangle_attention_update`: a triangle attention module (AlphaFold3 algorithms 14 and 15 as the
  clients write them): LayerNorm, the q/k/v/gate projections and the pair-bias projection's H
  outputs in one GEMM, then `gated_attention`.
- `swiglu`, `swiglu_transition`: (LayerNorm,) both SwiGLU projections in one GEMM, silu(a) * b in
  one kernel (ops.glue.swiglu)(, the output projection).

`fused` chooses our fused kernels for LayerNorm, SwiGLU and the gate (True) or PyTorch's eager ops
(False: our nn's reference backend, and under torch.compile, whose generated kernels fuse this glue
into its neighbours); the GEMMs are PyTorch's either way.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from tpfkit.ops import glue as glue_ops
from tpfkit.ops._common import autocast_dtype
from tpfkit.ops.attention import triangle_attention

__all__ = ["fusable", "layer_norm", "linears", "gated_attention", "triangle_attention_update",
           "swiglu", "swiglu_transition"]

Core = Callable[..., torch.Tensor]  # (q, k, v, bias, mask) -> o, as ops.attention.triangle_attention


def fusable() -> bool:
    """Whether the fused glue kernels are the faster choice here: not under torch.compile."""
    return not torch.compiler.is_compiling()


def layer_norm(ln: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """ln(x) for a LayerNorm module over x's last dim (one with weight, bias and eps: nn.LayerNorm
    or a client's); with `fused`, in one kernel that reads x in place and writes the dtype the
    next GEMM casts to under autocast (every consumer of these LayerNorms is a linear layer). A
    LayerNorm without weight or bias runs as the module runs it."""
    weight, bias, eps = (getattr(ln, name, None) for name in ("weight", "bias", "eps"))
    if not fused or weight is None or bias is None or eps is None:
        return ln(x)
    return glue_ops.layer_norm(x, weight, bias, eps, autocast_dtype(x) or x.dtype)


def linears(x: torch.Tensor, layers: Sequence[nn.Module]) -> torch.Tensor:
    """[layer(x) for layer in layers] concatenated along the last dim, as ONE GEMM over the
    layers' concatenated weights (nn.Linear or its subclasses: weight [out, in], bias [out] or
    None); a bias of zeros stands in for a layer without one where another has one. Outside
    autocast the weights take x's dtype (as the clients' linear layers do for 16-bit x)."""
    weights = [layer.weight for layer in layers]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    biases = [getattr(layer, "bias", None) for layer in layers]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b
                          for w, b in zip(weights, biases)])
    if autocast_dtype(x) is None and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return nn.functional.linear(x, weight, bias)


def _heads(t: torch.Tensor, H: int, D: int) -> torch.Tensor:
    """[B, N, S, H*D] -> [B, N, H, S, D], a view."""
    return t.unflatten(-1, (H, D)).transpose(2, 3)


def gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    bias: torch.Tensor, mask: Optional[torch.Tensor], out: nn.Module, heads: int,
                    head_dim: int, fused: bool, core: Core = triangle_attention) -> torch.Tensor:
    """out(sigmoid(g) * attention(q, k, v)) with the heads laid back into rows.

    q, k, v, g [B, N, S, H*D] (column slices of one GEMM's output, as `linears` gives them);
    bias [B, H, S, S] shared by the N slices; mask bool [B, N, S] (True = attend) or None; core
    the attention on [B, N, H, S, D] heads (ops.attention.triangle_attention, or what context
    parallelism or a client integration puts in its place). Returns [B, N, S, C_out]."""
    H, D = heads, head_dim
    o = core(_heads(q, H, D), _heads(k, H, D), _heads(v, H, D), bias.to(q.dtype), mask)
    if fused:  # the heads back to rows and the gate, in one pass
        h = glue_ops.gated_output(g, o)
    else:
        B, N, S, _ = g.shape
        h = torch.sigmoid(g) * o.transpose(2, 3).reshape(B, N, S, H * D)
    return linears(h, (out,))


def triangle_attention_update(x: torch.Tensor, mask: Optional[torch.Tensor], *, norm: nn.Module,
                              q: nn.Module, k: nn.Module, v: nn.Module, g: nn.Module,
                              bias: nn.Module, out: nn.Module, heads: int, head_dim: int,
                              fused: bool, core: Core = triangle_attention,
                              transpose_bias: bool = False) -> torch.Tensor:
    """A triangle attention module's update of x [*, I, J, C] (already transposed for the ending
    node, where the client transposes): row i of x attends over j, with the bias from the same
    normalized x, [h, i, j] <- bias(x)[i, j, h] ([h, i, j] <- bias(x)[j, i, h] with
    transpose_bias, OpenFold3's for its ending node). mask [*, I, J] bool (True = attend) or None.

    norm: the LayerNorm; q, k, v, g: the projections to H*D channels (g the gate's); bias: the
    pair-bias projection to H channels; out: the output projection. The five projections run as
    one GEMM. Returns [*, I, J, C_out] in the GEMM's dtype."""
    lead, (I, J) = x.shape[:-3], x.shape[-3:-1]
    HD = heads * head_dim
    y = layer_norm(norm, x, fused)
    p = linears(y, (q, k, v, g, bias))
    p = p.reshape(-1, I, J, p.shape[-1])  # [B, I, J, 4 H D + H], a view
    q_, k_, v_, g_, b_ = p.split([HD, HD, HD, HD, heads], dim=-1)
    b_ = b_.permute(0, 3, 2, 1) if transpose_bias else b_.permute(0, 3, 1, 2)  # [B, H, I, J]
    if mask is not None:
        mask = mask.expand(*lead, I, J).reshape(-1, I, J)
    o = gated_attention(q_, k_, v_, g_, b_, mask, out, heads, head_dim, fused, core)
    return o.reshape(*lead, I, J, o.shape[-1])


def swiglu(x: torch.Tensor, *, a: nn.Module, b: nn.Module, fused: bool) -> torch.Tensor:
    """silu(a(x)) * b(x): both projections in one GEMM, then (with `fused`) silu(a) * b and its
    gradient in one kernel each (ops.glue.swiglu)."""
    ab = linears(x, (a, b))
    if fused:
        return glue_ops.swiglu(ab)
    a_, b_ = ab.chunk(2, dim=-1)
    return nn.functional.silu(a_) * b_


def swiglu_transition(x: torch.Tensor, *, norm: nn.Module, a: nn.Module, b: nn.Module,
                      out: nn.Module, fused: bool) -> torch.Tensor:
    """out(silu(a(norm(x))) * b(norm(x))) (AlphaFold3 algorithm 11): the LayerNorm, both
    projections in one GEMM, the SwiGLU and the output projection. x [..., C]."""
    return linears(swiglu(layer_norm(norm, x, fused), a=a, b=b, fused=fused), (out,))
