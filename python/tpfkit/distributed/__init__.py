"""Context parallelism: the pair representation sharded by rows over the ranks of a process group.

Memory per rank is O(N^2 / P). Built on torch.distributed (NCCL on GPUs, gloo on CPUs):
- RowSharding: which rows each rank holds (N padded to a multiple of P), sharding and gathering;
- transpose_pair: rows of z -> rows of z^T (the ending-node attention runs on z^T);
- gather_rows, sum_gradients: into and out of a replicated computation (the single track);
- ring_triangle_attention: starting-node triangle attention with the bias rows passed around a ring;
- sharded_triangle_contraction, sharded_triangle_multiplicative_update: the triangle
  multiplication, its contraction through channel sharding;
- ContextParallel: a PairFormer run on those pieces, each rank feeding its rows.
"""
from tpfkit.distributed.attention import ring_triangle_attention
from tpfkit.distributed.collectives import gather_rows, sum_gradients, transpose_pair
from tpfkit.distributed.context_parallel import ContextParallel
from tpfkit.distributed.sharding import RowSharding
from tpfkit.distributed.trimul import (
    sharded_triangle_contraction,
    sharded_triangle_multiplicative_update,
)

__all__ = ["ContextParallel", "RowSharding", "transpose_pair", "gather_rows", "sum_gradients",
           "ring_triangle_attention", "sharded_triangle_contraction",
           "sharded_triangle_multiplicative_update"]
