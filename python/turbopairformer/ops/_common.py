"""Helpers shared by the torch ops: argument checks, streams, tensors saved by name."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_to_dlpack = torch._C._to_dlpack


def _capsule(a):
    if isinstance(a, torch.Tensor):
        return _to_dlpack(a)
    if isinstance(a, (list, tuple)):
        return [_capsule(e) for e in a]
    return a


def native(fn, *args):
    """Calls an entry point of turbopairformer._C with every tensor argument (also inside lists)
    handed over as a DLPack capsule. The binding takes tensors too, but imports each through
    Python's `__dlpack__` protocol, about 2 us a tensor against 0.2 us for a capsule: with up to
    30 tensors per call and hundreds of calls per training step, that host time showed in eager
    step times. The capsule is exported without autograd's check, so callers pass only tensors
    that the entry point reads or that they allocated for its outputs (the entry points never
    keep them)."""
    return fn(*[_capsule(a) for a in args])


def eager_autograd(op, impl, setup_context, backward):
    """The custom op `op` (whose body is `impl`) dispatched by mode: under torch.compile the custom
    op, which the compiler sees through its fake implementation; in eager mode a plain
    autograd.Function over impl with op's setup_context and a backward that calls the backward
    op's body directly. A custom op costs 100-200 us of host time per call
    and backward in eager mode, more than the short kernels behind it take on the GPU."""

    class Eager(torch.autograd.Function):
        # forward takes ctx (no separate setup_context): apply() then skips binding the arguments
        # to forward's signature through inspect, 20 us a call.
        @staticmethod
        def forward(ctx, *inputs):
            output = impl(*inputs)
            ctx.set_materialize_grads(False)  # outputs kept for the backward get no gradient
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    def call(*inputs):
        return op(*inputs) if torch.compiler.is_compiling() else Eager.apply(*inputs)

    return call


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast gives matmuls on x's device, or None when autocast is off there."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


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


def save_named(ctx, **tensors: Optional[torch.Tensor]) -> None:
    """Saves tensors for backward under their names (load_named gives them back by name)."""
    ctx._saved_names = tuple(tensors)
    ctx.save_for_backward(*tensors.values())


def load_named(ctx) -> SimpleNamespace:
    return SimpleNamespace(**dict(zip(ctx._saved_names, ctx.saved_tensors)))
