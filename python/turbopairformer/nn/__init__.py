"""PairFormer modules with AlphaFold3's math and OpenFold3's parameter names.

Every module takes backend="reference" (plain PyTorch, no custom ops) or "turbo" (our ops); the
parameters are the same either way, so a state dict moves between backends unchanged.
"""
from turbopairformer.nn._layers import BACKENDS
from turbopairformer.nn.attention import AttentionPairBias, GatedAttention, TriangleAttention
from turbopairformer.nn.pairformer import PairFormer, PairFormerBlock, PairStack, set_backend
from turbopairformer.nn.transition import PairTransition, SwiGLU, Transition
from turbopairformer.nn.trimul import TriangleMultiplication

__all__ = [
    "BACKENDS", "AttentionPairBias", "GatedAttention", "PairFormer", "PairFormerBlock",
    "PairStack", "PairTransition", "SwiGLU", "Transition", "TriangleAttention",
    "TriangleMultiplication", "set_backend",
]
