"""Helpers shared by the torch ops: argument checks, streams, tensors saved by name."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device as an integer, 0 for CPU tensors."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def require_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_float(x: torch.Tensor, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def require_same(x: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {x.device}")
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {x.dtype}")


def inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with stride 1 in its last dimension (the kernels take other strides as they are)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def detached(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach()


def save_named(ctx, **tensors: Optional[torch.Tensor]) -> None:
    """Saves tensors for backward under their names (load_named gives them back by name)."""
    ctx._saved_names = tuple(tensors)
    ctx.save_for_backward(*tensors.values())


def load_named(ctx) -> SimpleNamespace:
    return SimpleNamespace(**dict(zip(ctx._saved_names, ctx.saved_tensors)))
