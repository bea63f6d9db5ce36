"""What the client integrations share: a set of attribute changes applied together and undone
together, checks that a client's call sites are where the integration expects them (with the
installed version in the error), a wrapper that forces a keyword argument of a method, and the one
rule of which inputs our ops take (attention_takes, trimul_takes, glue_takes): a patched layer
given others runs the client's own PyTorch path (Fallback; fusing() for the fused module forwards),
decided up front from the inputs' dtype, device and shapes, never by catching our ops' errors (a
real bug still raises)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

_ABSENT = object()

# What our ops take (src/ops, src/kernels): float32, bfloat16 and float16 on the CPU and CUDA. On
# CUDA, 16-bit triangle attention runs the kernels, whose forward and backward take head dims
# D = 8, 16, ..., 128 (float32 takes PyTorch's math there, any D); the triangle multiplication's
# kernels (every dtype) take D a multiple of 8 up to 128.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")
_ATTENTION_FORWARD_HEAD_DIMS = frozenset(range(8, 129, 8))
_ATTENTION_BACKWARD_HEAD_DIMS = frozenset(range(8, 129, 8))
_TRIMUL_MAX_D = 128
# The fused LayerNorm (ops.glue.layer_norm, include/tpf/glue.h) takes up to 1024 channels.
_LAYER_NORM_MAX_C = 1024


def op_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype our ops compute x in: autocast's on x's device for a float32, bfloat16 or float16
    x (as our ops and the client's projections cast it), x's own otherwise (float64 is not
    autocast's to cast)."""
    if x.dtype in _DTYPES and x.device.type in _DEVICES and torch.is_autocast_enabled(
            x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def attention_rule(dtype: torch.dtype, device: str, head_dim: int, grad: bool) -> bool:
    """Whether our triangle attention takes q, k, v of this dtype (as computed: op_dtype), device
    type and head dim; grad: whether a backward will follow."""
    if dtype not in _DTYPES or device not in _DEVICES or head_dim < 1:
        return False
    if device == "cuda" and dtype != torch.float32:
        return head_dim in (_ATTENTION_BACKWARD_HEAD_DIMS if grad else
                            _ATTENTION_FORWARD_HEAD_DIMS)
    return True


def trimul_rule(dtype: torch.dtype, device: str, width: int) -> bool:
    """Whether our triangle multiplication takes x of this dtype (op_dtype), device type and
    width D."""
    if dtype not in _DTYPES or device not in _DEVICES or width < 1:
        return False
    return device != "cuda" or (width % 8 == 0 and width <= _TRIMUL_MAX_D)


def glue_rule(dtype: torch.dtype, device: str, width: int) -> bool:
    """Whether our fused glue (LayerNorm, SwiGLU, the attention gate) takes x of this dtype
    (op_dtype), device type and width C (the LayerNorm's channels)."""
    return dtype in _DTYPES and device in _DEVICES and 1 <= width <= _LAYER_NORM_MAX_C


def _needs_grad(x: torch.Tensor, layer: Optional[torch.nn.Module]) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or (layer is not None and
                               any(p.requires_grad for p in layer.parameters()))


def attention_takes(x: torch.Tensor, head_dim: int,
                    layer: Optional[torch.nn.Module] = None) -> bool:
    """Whether our triangle attention takes what a triangle attention layer makes of its input x
    (the pair representation it projects q, k, v from) with heads of head_dim; layer: the one
    whose parameters make q, k, v (a backward follows if x or one of them requires grad)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return False
    dtype, device = op_dtype(x), x.device.type
    # Only the CUDA kernels' rule asks whether a backward follows.
    grad = device == "cuda" and dtype in _DTYPES[1:] and _needs_grad(x, layer)
    return attention_rule(dtype, device, head_dim, grad)


def trimul_takes(x: torch.Tensor) -> bool:
    """Whether our triangle multiplication takes a layer's input x [*, S, S, D]."""
    return (isinstance(x, torch.Tensor) and x.dim() >= 3 and
            trimul_rule(op_dtype(x), x.device.type, x.shape[-1]))


def glue_takes(x: torch.Tensor) -> bool:
    """Whether our fused glue takes a module's input x [..., C] (a transition's, a triangle
    attention's before its LayerNorm)."""
    return (isinstance(x, torch.Tensor) and x.dim() >= 1 and
            glue_rule(op_dtype(x), x.device.type, x.shape[-1]))


def plain_linears(*layers: Any) -> bool:
    """Whether the client's layers are linear layers the fused forwards run as they are: a weight
    [out, in] and a bias or none, computed in the input's dtype (no `precision` of their own, as
    Boltz's and Protenix's Linear may set)."""
    return all(isinstance(getattr(layer, "weight", None), torch.Tensor) and
               getattr(layer, "weight").dim() == 2 and
               getattr(layer, "precision", None) is None for layer in layers)


def triangle_attention_takes(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether a client's triangle attention module (layer_norm, a pair-bias projection, mha with
    linear_q, linear_k, linear_v, linear_g, linear_o, c_hidden, no_heads) runs its fused forward
    (functional.triangle_attention_update) on x: our attention and glue take x, and its layers are
    plain (a gated mha). `bias` names the module's pair-bias projection."""
    mha = getattr(layer, "mha", None)
    projections = [getattr(mha, name, None) for name in
                   ("linear_q", "linear_k", "linear_v", "linear_g", "linear_o")]
    return (mha is not None and plain_linears(*projections, pair_bias_linear(layer)) and
            attention_takes(x, mha.c_hidden, layer) and glue_takes(x))


def pair_bias_linear(layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A triangle attention module's pair-bias projection: OpenFold3's linear_z, Boltz's and
    Protenix's linear."""
    return getattr(layer, "linear_z", None) or getattr(layer, "linear", None)


def fused_triangle_attention(layer: torch.nn.Module, x: torch.Tensor,
                             keep: Optional[torch.Tensor], bias: torch.nn.Module, core: Callable,
                             **extra: Any) -> torch.Tensor:
    """A client's TriangleAttention module (fields starting, layer_norm and mha with linear_q, _k,
    _v, _g, _o, no_heads, c_hidden: the three clients share them) through
    functional.triangle_attention_update, the ending node transposed in and out as the clients do.
    keep: the bool key mask [*, I, J] (True = attend) or None; bias: the module's pair-bias
    projection; core: the attention (each integration's own, so tests can watch it); extra: e.g.
    OpenFold3's transpose_bias."""
    from tpfkit.nn import functional as F  # nn imports the ops, which import nothing here

    if not layer.starting:
        x = x.transpose(-2, -3)
        keep = None if keep is None else keep.transpose(-1, -2)
    mha = layer.mha
    out = F.triangle_attention_update(
        x, keep, norm=layer.layer_norm, q=mha.linear_q, k=mha.linear_k, v=mha.linear_v,
        g=mha.linear_g, bias=bias, out=mha.linear_o, heads=mha.no_heads, head_dim=mha.c_hidden,
        fused=F.fusable(), core=core, **extra)
    return out if layer.starting else out.transpose(-2, -3)


class Fallback(NamedTuple):
    """A patched method's way back to the client's own path: takes(self, *inputs) says whether
    our ops take the inputs (the method's arguments of those names); when not, the method runs
    with `values` (the client's switch set to its PyTorch path), its other arguments as given."""
    inputs: tuple[str, ...]
    takes: Callable[..., bool]
    values: dict


class IntegrationError(RuntimeError):
    """The client package is missing, or lacks a call site the integration replaces."""


class Integration:
    """One client's changes. `plan(integration)` returns the changes as (owner, name, make) triples,
    owner a module or class, make(original) the new value (original is the attribute the owner
    itself holds, or None where it holds none); it raises IntegrationError before anything is
    changed if a call site is missing. enable() applies them all or none (a change that fails
    undoes those made before it), disable() restores exactly what was there (an attribute the owner
    did not hold is removed again)."""

    def __init__(self, package: str, distributions: tuple[str, ...], tested: str,
                 plan: Callable[["Integration"], list[tuple[Any, str, Callable[[Any], Any]]]]):
        self.package = package
        self.distributions = distributions
        self.tested = tested
        self._plan = plan
        self._saved: Optional[list[tuple[Any, str, Any]]] = None

    def is_enabled(self) -> bool:
        return self._saved is not None

    def enable(self) -> None:
        if self._saved is not None:
            return
        changes = self._plan(self)
        saved = []
        try:
            for owner, name, make in changes:
                original = vars(owner).get(name, _ABSENT)
                value = make(None if original is _ABSENT else original)
                saved.append((owner, name, original))
                setattr(owner, name, value)
        except BaseException:
            _restore(saved)  # all or nothing
            raise
        self._saved = saved

    def disable(self) -> None:
        if self._saved is None:
            return
        saved, self._saved = self._saved, None
        _restore(saved)

    def enabled(self) -> contextlib.AbstractContextManager:
        """Our ops inside the block; what was there before (on or off) after it."""
        return self._switched(True)

    def disabled(self) -> contextlib.AbstractContextManager:
        """The client's own code inside the block; what was there before after it."""
        return self._switched(False)

    @contextlib.contextmanager
    def _switched(self, on: bool) -> Iterator[None]:
        was = self.is_enabled()
        self._set(on)
        try:
            yield
        finally:
            self._set(was)

    def _set(self, on: bool) -> None:
        if on:
            self.enable()
        else:
            self.disable()

    def functions(self) -> tuple[Callable, ...]:
        """A client module's public functions: enable, disable, enabled, disabled, is_enabled."""
        return self.enable, self.disable, self.enabled, self.disabled, self.is_enabled

    def installed(self) -> str:
        """'<distribution> <version>' of the package as imported, e.g. 'boltz-community 2.12.0'."""
        module = sys.modules.get(self.package)
        where = Path(module.__file__).parent.resolve() if module and module.__file__ else None
        found = []
        for name in self.distributions:
            try:
                dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            found.append(f"{name} {dist.version}")
            if where is not None and Path(dist.locate_file(self.package)).resolve() == where:
                return found[-1]
        return " or ".join(found) if found else f"{self.package} of unknown version"

    def module(self, name: str) -> ModuleType:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            if e.name is not None and (e.name == self.package or
                                       e.name.startswith(self.package + ".")):
                raise IntegrationError(
                    f"{self.package} is not installed (supported: {self.tested}); {e}") from e
            raise

    def missing(self, what: str) -> IntegrationError:
        return IntegrationError(
            f"tpfkit.integrations supports {self.tested}: the installed "
            f"{self.installed()} lacks {what}, where our ops would be called")

    def attribute(self, owner: Any, name: str) -> Any:
        value = vars(owner).get(name, _ABSENT)
        if value is _ABSENT:
            raise self.missing(f"{_name(owner)}.{name}")
        return value

    def calls(self, function: Callable, name: str) -> None:
        """Checks that function's code looks `name` up (a global it calls, a flag it reads)."""
        code = getattr(inspect.unwrap(function), "__code__", None)  # under decorators
        if code is None or name not in code.co_names:
            raise self.missing(f"a use of {name} in {getattr(function, '__qualname__', function)}")

    def forcing(self, owner: type, method: str, when: Optional[Callable[..., bool]] = None,
                fallback: Optional[Fallback] = None,
                **values: Any) -> tuple[type, str, Callable[[Any], Any]]:
        """The change that makes owner.method run with these keyword arguments whatever its caller
        passed (when(*args, **kwargs) is true, if given), or, for inputs our ops do not take
        (fallback, if given), with fallback.values instead."""
        original = self.attribute(owner, method)
        signature = inspect.signature(original)
        parameters = list(signature.parameters)
        named = list(values) + (list(fallback.inputs) + list(fallback.values) if fallback else [])
        for name in named:
            if name not in parameters:
                raise self.missing(f"the argument {name} of {_name(owner)}.{method}")
        positions = {name: parameters.index(name) for name in named}
        defaults = {name: signature.parameters[name].default for name in named}

        def argument(args, kwargs, name):
            if positions[name] < len(args):
                return args[positions[name]]
            return kwargs.get(name, defaults[name])

        def setting(args, kwargs, chosen):
            args = list(args)
            for name, value in chosen.items():
                if positions[name] < len(args):
                    args[positions[name]] = value
                else:
                    kwargs[name] = value
            return args, kwargs

        def make(original):
            @functools.wraps(original)
            def forced(*args, **kwargs):
                if fallback is not None and not fallback.takes(
                        args[0], *(argument(args, kwargs, name) for name in fallback.inputs)):
                    args, kwargs = setting(args, kwargs, fallback.values)
                elif when is None or when(*args, **kwargs):
                    args, kwargs = setting(args, kwargs, values)
                return original(*args, **kwargs)
            return forced

        return owner, method, make

    def fusing(self, owner: type, method: str, fused: Callable[..., Any],
               base: Optional[tuple[type, str, Callable[[Any], Any]]] = None,
               ignoring: tuple[str, ...] = ()) -> tuple[type, str, Callable[[Any], Any]]:
        """The change that makes owner.method run `fused` (our fused forward on the client's
        parameters, given the method's arguments by name), which returns NotImplemented for
        inputs it does not take, decided up front; those run the method as `base` (a change of the
        same method, e.g. forcing()'s) makes it, or the client's own. `fused` names the method's
        parameters; `ignoring`: the method's parameters it may lack (ones that do not change what
        the fused path computes, e.g. a switch the kernel path overrides). An installed version
        whose method has other parameters is an IntegrationError."""
        original = self.attribute(owner, method)
        if base is not None and base[:2] != (owner, method):
            raise ValueError(f"base must change {_name(owner)}.{method}")
        signature = inspect.signature(original)
        parameters = list(signature.parameters)
        named = list(inspect.signature(fused).parameters)
        if [p for p in parameters if p not in ignoring] != named:
            raise self.missing(f"{_name(owner)}.{method}({', '.join(named)}) (it has "
                               f"({', '.join(parameters)}))")
        positions = [(name, parameters.index(name), signature.parameters[name].default)
                     for name in named]

        def make(original):
            slow = original if base is None else base[2](original)

            @functools.wraps(original)
            def forward(*args, **kwargs):
                out = fused(**{name: args[i] if i < len(args) else kwargs.get(name, default)
                               for name, i, default in positions})
                return slow(*args, **kwargs) if out is NotImplemented else out
            return forward

        return owner, method, make


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    """Puts back what saved records, last change first (an attribute the owner did not hold is
    removed again)."""
    for owner, name, original in reversed(saved):
        if original is _ABSENT:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, original)


def _name(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, ModuleType) else f"{owner.__module__}.{owner.__qualname__}"


def replace(owner: Any, name: str, value: Any) -> tuple[Any, str, Callable[[Any], Any]]:
    """The change that sets owner.name to value."""
    return owner, name, lambda original: value
