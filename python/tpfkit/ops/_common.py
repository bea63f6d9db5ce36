"""Helpers shared by the torch ops: calls into the C++ core, streams, scratch allocators, tensors
saved by name. Arguments are validated in C++ (src/ops); the checks here are of what C++ cannot see."""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Callable, Optional

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
    """Calls an entry point of tpfkit._C with every tensor argument (also inside lists)
    handed over as a DLPack capsule. The binding takes tensors too, but imports each through
    Python's `__dlpack__` protocol, about 2 us a tensor against 0.2 us for a capsule: with up to
    30 tensors per call and hundreds of calls per training step, that host time showed in eager
    step times. The capsule is exported without autograd's check, so callers pass only tensors
    that the entry point reads or that they allocated for its outputs (the entry points never
    keep them)."""
    return fn(*[_capsule(a) for a in args])


def eager_autograd(op, impl, setup_context, backward, list_arg: Optional[int] = None):
    """The custom op `op` (whose body is `impl`) dispatched by mode: under torch.compile the custom
    op, which the compiler sees through its fake implementation; in eager mode a plain
    autograd.Function over impl with op's setup_context and a backward that calls the backward
    op's body directly. A custom op costs 100-200 us of host time per call
    and backward in eager mode, more than the short kernels behind it take on the GPU.

    list_arg: the position of an input that is a list of tensors (and of its gradients, a list, in
    backward's result). Autograd does not look inside a list, so the eager route passes its
    tensors as arguments of their own, preceded by their count, and gathers them back."""

    def nest(flat):
        if list_arg is None:
            return flat
        n = flat[list_arg]
        end = list_arg + 1 + n
        return (*flat[:list_arg], list(flat[list_arg + 1:end]), *flat[end:])

    def flatten(inputs, fill):
        if list_arg is None:
            return inputs
        items = inputs[list_arg]
        return (*inputs[:list_arg], fill(items), *items, *inputs[list_arg + 1:])

    class Eager(torch.autograd.Function):
        # forward takes ctx (no separate setup_context): apply() then skips binding the arguments
        # to forward's signature through inspect, 20 us a call.
        @staticmethod
        def forward(ctx, *flat):
            inputs = nest(flat)
            output = impl(*inputs)
            ctx.set_materialize_grads(False)  # outputs kept for the backward get no gradient
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return flatten(backward(ctx, *grads), lambda items: None)

    def call(*inputs):
        if torch.compiler.is_compiling():
            return op(*inputs)
        return Eager.apply(*flatten(inputs, len))

    return call


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast gives matmuls on x's device, or None when autocast is off there."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device as an integer, 0 for CPU tensors."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


@functools.lru_cache(maxsize=None)
def _allocator(device: torch.device) -> Callable[[int], object]:
    def allocate(nbytes: int):
        return _to_dlpack(torch.empty(nbytes, dtype=torch.uint8, device=device))
    return allocate


def workspace(t: torch.Tensor) -> Optional[Callable[[int], object]]:
    """The allocator through which an op on t's CUDA device asks for its scratch, once it knows the
    size: PyTorch's caching allocator, stream-ordered, so the block may be reused by later work
    on the stream once the call has returned. None for CPU tensors (their paths need none)."""
    return _allocator(t.device) if t.is_cuda else None


def require_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with stride 1 in its last dimension (the kernels take other strides as they are)."""
    return x if x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def save_named(ctx, **tensors: Optional[torch.Tensor]) -> None:
    """Saves tensors for backward under their names (load_named gives them back by name)."""
    ctx._saved_names = tuple(tensors)
    ctx.save_for_backward(*tensors.values())


def load_named(ctx) -> SimpleNamespace:
    return SimpleNamespace(**dict(zip(ctx._saved_names, ctx.saved_tensors)))
