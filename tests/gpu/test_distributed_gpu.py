"""Context parallelism on GPUs (NCCL, one process per GPU, bfloat16) against the single-GPU result
with FlashAttention-3's rule: the checks of tests/python/test_distributed.py at GPU sizes (bias
ring, transposes, sharded contraction, replicated single track, 2-block PairFormer forward and
backward with masks and N not a multiple of the rank count, determinism), on 2 GPUs and, where the
machine has more, on all of them. Skips without 2 GPUs."""
import pytest
import torch
import torch.distributed as dist

from distributed_checks import CHECKS, failures_of, run_ranks
from seeds import seed_for

GPUS = torch.cuda.device_count()
WORLDS = sorted({2, GPUS}) if GPUS >= 2 else [2]

pytestmark = pytest.mark.skipif(GPUS < 2 or not dist.is_nccl_available(),
                                reason="needs 2 CUDA GPUs and NCCL")


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w}gpus")
def rank_results(request, tmp_path_factory):
    seed = seed_for(f"{request.node.nodeid}::{request.param}gpus")
    return request.param, *run_ranks(request.param, tmp_path_factory.mktemp("nccl"), seed,
                                     backend="nccl", dtype="bfloat16")


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_gpus(rank_results, check):
    failures = failures_of(check, *rank_results[:2], rank_results[2])
    assert not failures, failures
