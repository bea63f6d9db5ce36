import os
import sys

import pytest
import torch

import tpfkit as tpf

# Shared helpers (FP64 reference, FlashAttention-3's rule) live beside the CPU tests.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where there is no CUDA GPU or the build has no kernels."""
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU on this machine"
    elif not tpf.cuda_available():
        reason = "this build of tpfkit has no CUDA kernels"
    if reason:
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fills free memory of PyTorch's caching allocator with NaN, so an output element that a
    kernel fails to write shows up as NaN instead of a plausible leftover value."""
    block = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del block
