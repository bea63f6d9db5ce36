import pytest
import torch

import turbopairformer as tpf


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where there is no CUDA GPU or the build has no kernels."""
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU on this machine"
    elif not tpf.cuda_available():
        reason = "this build of turbopairformer has no CUDA kernels"
    if reason:
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))
