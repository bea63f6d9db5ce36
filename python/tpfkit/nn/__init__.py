"""PairFormer modules with AlphaFold3's math and OpenFold3's parameter names.

Every module takes backend="reference" (plain PyTorch, no custom ops) or "turbo" (our ops); the
parameters are the same either way, so a state dict moves between backends unchanged.
"""
from tpfkit.nn._layers import BACKENDS
from tpfkit.nn.attention import AttentionPairBias, GatedAttention, TriangleAttention
from tpfkit.nn.pairformer import PairFormer, PairFormerBlock, PairStack, set_backend
from tpfkit.nn.transition import PairTransition, SwiGLU, Transition
from tpfkit.nn.trimul import TriangleMultiplication

__all__ = [
    "BACKENDS", "AttentionPairBias", "GatedAttention", "PairFormer", "PairFormerBlock",
    "PairStack", "PairTransition", "SwiGLU", "Transition", "TriangleAttention",
    "TriangleMultiplication", "set_backend",
]
