"""What the client integrations share: a set of attribute changes applied together and undone
together, checks that a client's call sites are where the integration expects them (with the
installed version in the error), and a wrapper that forces a keyword argument of a method."""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

_ABSENT = object()


class IntegrationError(RuntimeError):
    """The client package is missing, or lacks a call site the integration replaces."""


class Integration:
    """One client's changes. `plan(integration)` returns the changes as (owner, name, make) triples,
    owner a module or class, make(original) the new value (original is the attribute the owner
    itself holds, or None where it holds none); it raises IntegrationError before anything is
    changed if a call site is missing. enable() applies them all, disable() restores exactly what
    was there (an attribute the owner did not hold is removed again)."""

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
        for owner, name, make in changes:
            original = vars(owner).get(name, _ABSENT)
            saved.append((owner, name, original))
            setattr(owner, name, make(None if original is _ABSENT else original))
        self._saved = saved

    def disable(self) -> None:
        if self._saved is None:
            return
        for owner, name, original in reversed(self._saved):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved = None

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
            f"turbopairformer.integrations supports {self.tested}: the installed "
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
                **values: Any) -> tuple[type, str, Callable[[Any], Any]]:
        """The change that makes owner.method run with these keyword arguments whatever its caller
        passed (when(*args, **kwargs) is true, if given)."""
        original = self.attribute(owner, method)
        parameters = list(inspect.signature(original).parameters)
        for name in values:
            if name not in parameters:
                raise self.missing(f"the argument {name} of {_name(owner)}.{method}")
        positions = {name: parameters.index(name) for name in values}

        def make(original):
            @functools.wraps(original)
            def forced(*args, **kwargs):
                if when is None or when(*args, **kwargs):
                    args = list(args)
                    for name, value in values.items():
                        if positions[name] < len(args):
                            args[positions[name]] = value
                        else:
                            kwargs[name] = value
                return original(*args, **kwargs)
            return forced

        return owner, method, make


def _name(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, ModuleType) else f"{owner.__module__}.{owner.__qualname__}"


def replace(owner: Any, name: str, value: Any) -> tuple[Any, str, Callable[[Any], Any]]:
    """The change that sets owner.name to value."""
    return owner, name, lambda original: value
