"""Plain PyTorch implementations of the ops (no custom kernels).

They are the `reference` backend of the nn modules, the same-precision baseline of the tests
(FlashAttention-3's rule) and the `torch_eager` peer of the benchmarks.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def triangle_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """einsum + softmax in the inputs' precision. Shapes as tpfkit.triangle_attention.

    Masked keys get the dtype's lowest value before the softmax; rows with no key are zeroed after
    it, so they give zeros and zero gradients as the op does.
    """
    B, N, H, S, D = q.shape
    if bias.dim() == 5:
        bias = bias.squeeze(1)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    s = torch.einsum("bnhqd,bnhkd->bnhqk", q, k) * scale + bias[:, None]
    if mask is None:
        return torch.einsum("bnhqk,bnhkd->bnhqd", torch.softmax(s, dim=-1), v)
    mask = mask.reshape(B, N, 1, 1, k.shape[3])
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1) * mask.any(dim=-1, keepdim=True).to(s.dtype)
    return torch.einsum("bnhqk,bnhkd->bnhqd", p, v)


def triangle_multiplicative_update_torch(
    x: torch.Tensor,
    direction: str = "outgoing",
    mask: Optional[torch.Tensor] = None,
    norm_in_weight: Optional[torch.Tensor] = None,
    norm_in_bias: Optional[torch.Tensor] = None,
    p_in_weight: Optional[torch.Tensor] = None,
    p_in_bias: Optional[torch.Tensor] = None,
    g_in_weight: Optional[torch.Tensor] = None,
    g_in_bias: Optional[torch.Tensor] = None,
    norm_out_weight: Optional[torch.Tensor] = None,
    norm_out_bias: Optional[torch.Tensor] = None,
    p_out_weight: Optional[torch.Tensor] = None,
    p_out_bias: Optional[torch.Tensor] = None,
    g_out_weight: Optional[torch.Tensor] = None,
    g_out_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    contract: Optional[Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]] = None,
) -> torch.Tensor:
    """The triangle multiplicative update in x's precision, as cuEquivariance's PyTorch fallback
    computes it: LayerNorms in (at least) float32, projections and the einsum contraction in x's
    dtype.
    Shapes as tpfkit.triangle_multiplicative_update; projection weights are required.
    contract(a, b, direction) replaces the einsums (context parallelism passes its sharded
    contraction; the rest is row-local).
    """
    dtype = x.dtype
    F = torch.nn.functional

    def cast(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(dtype)

    norm_dtype = torch.promote_types(dtype, torch.float32)

    def norm(t: torch.Tensor, w: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> torch.Tensor:
        w = None if w is None else w.to(norm_dtype)
        b = None if b is None else b.to(norm_dtype)
        return F.layer_norm(t.to(norm_dtype), t.shape[-1:], w, b, eps).to(dtype)

    for name, w in (("p_in_weight", p_in_weight), ("g_in_weight", g_in_weight),
                    ("p_out_weight", p_out_weight), ("g_out_weight", g_out_weight)):
        if w is None:
            raise ValueError(f"{name} is required by the PyTorch implementation")
    x_in = norm(x, norm_in_weight, norm_in_bias)
    ab = F.linear(x_in, cast(p_in_weight), cast(p_in_bias)) * torch.sigmoid(
        F.linear(x_in, cast(g_in_weight), cast(g_in_bias)))
    if mask is not None:
        ab = ab * mask.to(dtype).unsqueeze(-1)
    a, b = torch.chunk(ab, 2, dim=-1)
    if contract is not None:
        z = contract(a, b, direction)
    elif direction == "outgoing":
        z = torch.einsum("...ikd,...jkd->...ijd", a, b)
    else:
        z = torch.einsum("...kid,...kjd->...ijd", a, b)
    return F.linear(norm(z, norm_out_weight, norm_out_bias), cast(p_out_weight),
                    cast(p_out_bias)) * torch.sigmoid(
        F.linear(x_in, cast(g_out_weight), cast(g_out_bias)))
