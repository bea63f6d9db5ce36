"""TurboPairFormer: fast, deterministic PairFormer ops, data pipeline and training."""
# PyTorch first: loading it after the module with the CUDA kernels aborts at import on the GPU
# machine ("free(): invalid pointer" in PyTorch's own start-up); in this order both load cleanly.
import torch  # noqa: F401

from tpfkit import _C
from tpfkit.ops.attention import triangle_attention, triangle_attention_rows
from tpfkit.ops.trimul import triangle_multiplicative_update

__all__ = [
    "triangle_attention",
    "triangle_attention_rows",
    "triangle_multiplicative_update",
    "cuda_available",
]
__version__ = "0.1.0"


def cuda_available() -> bool:
    """Whether this build carries the CUDA kernels."""
    return bool(_C.cuda_available())
