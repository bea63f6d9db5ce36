"""Plain PyTorch implementations of the ops (no custom kernels).

They are the `reference` backend of the nn modules, the same-precision baseline of the tests
(FlashAttention-3's rule) and the `torch_eager` peer of the benchmarks.
"""
from __future__ import annotations

import math
from typing import Optional

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
    mask = mask.reshape(B, N, 1, 1, k.shape[3])
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1) * mask.any(dim=-1, keepdim=True).to(s.dtype)
    return torch.einsum("bnhqk,bnhkd->bnhqd", p, v)
