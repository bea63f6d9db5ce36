"""Context parallelism on 2 GPUs (NCCL, one process per GPU, bfloat16) against the single-GPU
result with FlashAttention-3's rule: the checks of tests/python/test_distributed.py at GPU sizes
(bias ring, transposes, sharded contraction, replicated single track, 2-block PairFormer forward and
backward with masks and N not a multiple of 2, determinism). Skips without 2 GPUs."""
import pytest
import torch
import torch.distributed as dist

from distributed_checks import CHECKS, failures_of, run_ranks

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
    reason="needs 2 CUDA GPUs and NCCL")


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return 2, *run_ranks(2, tmp_path_factory.mktemp("nccl"), backend="nccl", dtype="bfloat16")


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_two_gpus(rank_results, check):
    failures = failures_of(check, *rank_results[:2], rank_results[2])
    assert not failures, failures
