"""The package's build backend: scikit-build-core's, with one addition.

Where the build will compile the CUDA kernels (nvcc is found and neither TPF_CUDA=OFF, a prebuilt
TPF_CUDA_LIB nor TPF_CUTLASS_INCLUDE is given), the CUTLASS/CuTe headers' wheel, nvidia-cutlass,
joins the build requirements, so that a plain `pip install .` (build isolation) finds them. It is
6 MB, but pip installs its Python dependencies with it (scipy, cuda-python, networkx: about 50 MB
more, cached after the first time), so a build without nvcc does not ask for it. Mirrors
src/CMakeLists.txt's search for nvcc. Without build isolation (scripts/setup) nothing here runs
that installs anything: the headers come from the environment (CMake asks its Python).
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (the backend's hooks, re-exported)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

CUTLASS = "nvidia-cutlass==4.2.0.0"


def _setting(config_settings: dict | None, name: str) -> str:
    """A CMake define as pyproject.toml passes it: -C cmake.define.NAME=... or the environment."""
    for key, value in (config_settings or {}).items():
        if key in (f"cmake.define.{name}", f"skbuild.cmake.define.{name}"):
            return str(value)
    return os.environ.get(name, "")


def _nvcc() -> str | None:
    if os.environ.get("CUDACXX"):
        return os.environ["CUDACXX"]
    found = shutil.which("nvcc")
    if found:
        return found
    roots = ["/usr/local/cuda"] + [os.environ[v] for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    for root in roots:
        path = os.path.join(root, "bin", "nvcc")
        if os.access(path, os.X_OK):
            return path
    return None


def builds_kernels(config_settings: dict | None = None) -> bool:
    if _setting(config_settings, "TPF_CUDA").upper() == "OFF":
        return False
    if _setting(config_settings, "TPF_CUDA_LIB") or _setting(config_settings, "TPF_CUTLASS_INCLUDE"):
        return False
    return _nvcc() is not None


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    requires = list(_skbuild.get_requires_for_build_wheel(config_settings))
    return requires + [CUTLASS] if builds_kernels(config_settings) else requires


def get_requires_for_build_editable(config_settings: dict | None = None) -> list[str]:
    requires = list(_skbuild.get_requires_for_build_editable(config_settings))
    return requires + [CUTLASS] if builds_kernels(config_settings) else requires
