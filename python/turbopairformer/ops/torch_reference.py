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
    """einsum + softmax in the inputs' precision. Shapes as turbopairformer.triangle_attention.

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
    mask = mask.reshape(B, N, 1, 1, S)
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
    """AlphaFold3 algorithms 12 (outgoing) and 13 (incoming) in the inputs' precision.

    Arguments, shapes and weight layout as cuequivariance_torch.triangle_multiplicative_update:
    x [B, S, S, D], mask [B, S, S], p_in_weight and g_in_weight [2D, D] (rows of a, then of b),
    p_out_weight and g_out_weight [D, D]; biases may be None. contract(a, b, direction) replaces
    the einsums (context parallelism passes its sharded contraction; the rest is row-local).
    """
    if direction not in ("outgoing", "incoming"):
        raise ValueError(f"direction must be 'outgoing' or 'incoming', got {direction!r}")
    D = x.shape[-1]
    x_ln = torch.nn.functional.layer_norm(x, (D,), norm_in_weight, norm_in_bias, eps)
    ab = torch.sigmoid(torch.nn.functional.linear(x_ln, g_in_weight, g_in_bias)) * \
        torch.nn.functional.linear(x_ln, p_in_weight, p_in_bias)
    if mask is not None:
        ab = ab * mask.unsqueeze(-1).to(ab.dtype)
    a, b = ab[..., :D], ab[..., D:]
    if contract is not None:
        z = contract(a, b, direction)
    elif direction == "outgoing":
        z = torch.einsum("bikc,bjkc->bijc", a, b)
    else:
        z = torch.einsum("bkic,bkjc->bijc", a, b)
    z = torch.nn.functional.layer_norm(z, (D,), norm_out_weight, norm_out_bias, eps)
    gate = torch.sigmoid(torch.nn.functional.linear(x_ln, g_out_weight, g_out_bias))
    return gate * torch.nn.functional.linear(z, p_out_weight, p_out_bias)
