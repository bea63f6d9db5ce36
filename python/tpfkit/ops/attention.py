"""Triangle attention as a torch custom op (CPU path and CUDA kernels), with autograd.

Layout (cuEquivariance's): q, k, v [B, N, H, S, D]; bias [B, 1, H, S, S] or [B, H, S, S], shared by
the N slices; mask bool [B, N, 1, 1, S] or [B, N, S], True = attend. A query row whose keys are all
masked gives zeros and zero gradients. The C++ core validates every argument (src/ops/attention.cpp).
cuEquivariance's other forms are taken as it takes them (_cueq_forms, the one place that maps them
onto ours): the B = 1 form without the batch dimension, a mask of any dtype, a float32 bias with
16-bit q, k, v, and q, k, v under autocast in the autocast dtype.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpfkit import _C
from tpfkit.ops.torch_reference import triangle_attention_torch
from tpfkit.ops._common import (
    FLOAT_DTYPES,
    autocast_dtype,
    eager_autograd,
    inner_contiguous,
    load_named,
    native,
    require_tensor,
    save_named,
    stream_of,
    workspace,
)

__all__ = ["triangle_attention", "triangle_attention_rows"]


@torch.library.custom_op("tpfkit::triangle_attention_fwd", mutates_args=())
def _attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    keep_residual: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attention_fwd_impl(q, k, v, bias, mask, scale, keep_residual)


def _attention_fwd_impl(q, k, v, bias, mask, scale, keep_residual):
    o, lse, residual = _fwd_outputs(q, keep_residual)
    native(
        _C.attention_forward,
        q, k, v, bias, mask, o, lse,
        residual if residual.numel() else None, scale, workspace(q), stream_of(q))
    return o, lse, residual


def _fwd_outputs(q: torch.Tensor, keep_residual: bool):
    o = q.new_empty(q.shape)
    # float32 inputs on the CPU keep a float64 log-sum-exp: the backward recomputes probabilities
    # from it, and a float32 one would cost them a few ulps against a stored softmax.
    lse_dtype = torch.float64 if q.dtype == torch.float32 and not q.is_cuda else torch.float32
    lse = q.new_empty(q.shape[:-1], dtype=lse_dtype)  # [B, N, H, S] for a valid q
    # O's rounding kept for the backward's delta (output-residual compensation); the CPU path
    # keeps it at float32 too, where it is the rounding of its FP64 accumulator.
    with_residual = keep_residual and (q.dtype != torch.float32 or not q.is_cuda)
    residual = q.new_empty(q.shape if with_residual else (0,), dtype=torch.bfloat16)
    return o, lse, residual


@_attention_fwd.register_fake
def _(q, k, v, bias, mask, scale, keep_residual):
    return _fwd_outputs(q, keep_residual)


@torch.library.custom_op("tpfkit::triangle_attention_bwd", mutates_args=())
def _attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    o: torch.Tensor,
    lse: torch.Tensor,
    residual: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attention_bwd_impl(grad_out, q, k, v, bias, mask, o, lse, residual, scale)


def _attention_bwd_impl(grad_out, q, k, v, bias, mask, o, lse, residual, scale):
    dq, dk, dv, dbias = _bwd_outputs(q, k, v, bias)
    native(
        _C.attention_backward,
        q, k, v, bias, mask, o,
        lse, grad_out, residual if residual.numel() else None,
        dq, dk, dv, dbias, scale, workspace(q), stream_of(q))
    return dq, dk, dv, dbias


def _bwd_outputs(q, k, v, bias):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), bias.new_empty(bias.shape)


@_attention_bwd.register_fake
def _(grad_out, q, k, v, bias, mask, o, lse, residual, scale):
    return _bwd_outputs(q, k, v, bias)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, scale, _ = inputs
    o, lse, residual = output
    save_named(ctx, q=q, k=k, v=v, bias=bias, mask=mask, o=o, lse=lse, residual=residual)
    ctx.scale = scale


def _backward(bwd):  # through the backward custom op (torch.compile) or its body (eager)
    def backward(ctx, grad_o, grad_lse, grad_residual):
        s = load_named(ctx)
        dq, dk, dv, dbias = bwd(_tma_rows(grad_o), s.q, s.k, s.v, s.bias, s.mask, s.o,
                                s.lse, s.residual, ctx.scale)
        return dq, dk, dv, dbias, None, None, None
    return backward


_attention_fwd.register_autograd(_backward(_attention_bwd), setup_context=_setup_context)
_attention_call = eager_autograd(_attention_fwd, _attention_fwd_impl, _setup_context,
                                 _backward(_attention_bwd_impl))


def _scale(scale: Optional[float], q: torch.Tensor) -> float:
    """scale, by default 1/sqrt(D) (any number where q has no head dim: C++ rejects that q)."""
    if scale is not None:
        if not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
        return float(scale)
    D = q.shape[-1] if q.dim() else 0
    return 1.0 / math.sqrt(D) if D > 0 else 1.0


def _cueq_forms(q, k, v, bias, mask):
    """cuEquivariance's forms of the arguments in ours, as its triangle_attention reads them; any
    other form is passed on as given, for C++ to validate and name (it also takes the bias
    [B, 1, H, S, S] and the mask [B, N, 1, 1, S]):
    - q, k, v [N, H, S, D] for B = 1 (the output keeps B: [1, N, H, S, D], as cuEquivariance's
      does), the bias [H, S, S] and the mask [N, 1, 1, S] without the batch dimension;
    - a mask of any dtype, cast to bool (nonzero = attend);
    - under autocast on q's device, q, k, v cast to its dtype (not float64, as autocast; nor the
      bias);
    - a floating bias whose dtype is not q's taken in float32 (exact from 16 bits; with 16-bit
      q, k, v both paths read it as float32 and return its gradient in float32)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        require_tensor(x, name)
    if mask is not None:
        require_tensor(mask, "mask")
    if q.dim() == 4:
        q, k, v = (t.unsqueeze(0) if t.dim() == 4 else t for t in (q, k, v))
    if bias.dim() == 3:
        bias = bias.unsqueeze(0)
    if mask is not None:
        if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
            mask = mask.unsqueeze(0)
        if mask.dtype != torch.bool:
            mask = mask.to(torch.bool)
    dtype = autocast_dtype(q)
    if dtype is not None:
        q, k, v = (t.to(dtype) if t.dtype in FLOAT_DTYPES else t for t in (q, k, v))
    if bias.is_floating_point() and q.is_floating_point() and bias.dtype != q.dtype:
        bias = bias.float()
    return q, k, v, bias, mask


def _tma_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the CUDA kernels' TMA copies need it (start and every stride on 16 bytes: q, k, v and
    the output gradient), copied only when it is not. The start is judged by the storage offset
    (PyTorch's allocations start on 256 bytes), which traced (fake) tensors also have."""
    x = inner_contiguous(x)
    if not x.is_cuda:
        return x
    item = x.element_size()
    if x.storage_offset() * item % 16 == 0 and all(s * item % 16 == 0 for s in x.stride()[:-1]):
        return x
    # A copy (contiguous() would return x itself where only its start is off).
    return x.clone(memory_format=torch.contiguous_format) if x.shape[-1] * item % 16 == 0 else x


def _run(q, k, v, bias, mask, scale, residual):
    for name, x in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        require_tensor(x, name)
    if mask is not None:
        require_tensor(mask, "mask")
    scale = _scale(scale, q)
    if q.is_cuda and q.dtype == torch.float32:
        # The CUDA kernels are BF16/FP16 (tensor cores); float32 CUDA tensors take PyTorch's math,
        # after the op's own validation.
        # (Validated as the kernels would take them, inner dims made contiguous: PyTorch's math
        # takes any strides, e.g. Protenix's bias [B, H, S, S] permuted from [B, S, S, H].)
        native(_C.attention_check_inputs, *(inner_contiguous(x) for x in (q, k, v, bias)),
               None if mask is None else inner_contiguous(mask), scale)
        return triangle_attention_torch(q, k, v, bias, mask, scale)
    o, _, _ = _attention_call(
        _tma_rows(q), _tma_rows(k), _tma_rows(v), inner_contiguous(bias),
        None if mask is None else inner_contiguous(mask), scale,
        bool(residual) and _needs_grad(q, k, v, bias))
    return o


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will ask for the backward: when not, the forward keeps no residual."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def triangle_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    *,
    residual: bool = True,
) -> torch.Tensor:
    """Triangle attention: softmax(scale * q k^T + bias, masked keys excluded) v, per slice.

    q, k, v: [B, N, H, S, D]; bias: [B, 1, H, S, S] or [B, H, S, S]; mask: bool [B, N, 1, 1, S] or
    [B, N, S] (True = attend); scale defaults to 1/sqrt(D). Returns o [B, N, H, S, D].
    residual: keep the BF16 residual of O's rounding for the backward's softmax correction
    ("output-residual compensation", 16-bit inputs only); False gives the uncompensated backward.
    Also cuEquivariance's forms (see _cueq_forms): [N, H, S, D] for B = 1 (o is then
    [1, N, H, S, D], as cuEquivariance returns it), a mask of any dtype, a bias of another float
    dtype (taken in float32 and read as float32), autocast.
    """
    q, k, v, bias, mask = _cueq_forms(q, k, v, bias, mask)
    # C++ takes any key count (triangle_attention_rows); here the keys are the queries' tokens.
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 5
            and q.shape[3] != k.shape[3]):
        raise ValueError(f"k must have q's shape {list(q.shape)} (triangle_attention_rows takes "
                         f"other key counts), got {list(k.shape)}")
    return _run(q, k, v, bias, mask, scale, residual)


def triangle_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    *,
    residual: bool = True,
) -> torch.Tensor:
    """Triangle attention for a range of Sq queries against all Sk keys (context parallelism).

    q: [B, N, H, Sq, D]; k, v: [B, N, H, Sk, D]; bias: [B, H, Sq, Sk], the bias rows of those
    queries; mask: bool [B, N, Sk]. Each softmax runs over all Sk keys, so the result equals the
    matching rows of triangle_attention (which is the same op with Sq = Sk). Autograd as
    triangle_attention.
    """
    return _run(q, k, v, bias, mask, scale, residual)
