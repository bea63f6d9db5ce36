"""The suite's accuracy rule (accuracy.py) itself: it passes a correctly rounded result against a
baseline that happens to be exact, and fails real errors."""
import pytest
import torch

from accuracy import accuracy_failure, assert_accurate, unit_roundoff


@pytest.fixture(autouse=True)
def _not_swept(monkeypatch):
    """These tests feed the rule wrong results on purpose: their ratios are not accuracy checks of
    an op, so tests/sweep_accuracy.py does not collect them."""
    monkeypatch.delenv("TPF_ACCURACY_LOG", raising=False)


def noisy(ref, dtype, relative, gen):
    """ref with an error of `relative` x u(dtype) x |ref| per element, random in sign."""
    sign = torch.randint(0, 2, ref.shape, generator=gen).double() * 2 - 1
    return ref + sign * relative * unit_roundoff(dtype) * ref.abs()


def test_correct_rounding_passes_against_an_exact_baseline(seed):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(3, generator=gen, dtype=torch.float64)
    got = ref.to(torch.bfloat16)
    assert_accurate("x", got, ref.clone(), ref, roundings=1)  # the baseline's error is 0


def test_large_tensor_three_times_less_accurate_than_baseline_fails(seed):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(4096, generator=gen, dtype=torch.float64)
    base = noisy(ref, torch.bfloat16, 2.0, gen)
    got = noisy(ref, torch.bfloat16, 6.0, gen)
    assert accuracy_failure("x", got, base, ref, roundings=1, dtype=torch.bfloat16)
    assert accuracy_failure("x", noisy(ref, torch.bfloat16, 3.0, gen), base, ref, roundings=1,
                            dtype=torch.bfloat16) is None


def test_one_wrong_element_fails(seed):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(64, 64, generator=gen, dtype=torch.float64)
    got = ref.to(torch.bfloat16).double()
    got[17, 5] += 0.1 * ref.abs().max()
    assert accuracy_failure("x", got, ref.to(torch.bfloat16), ref, roundings=2,
                            dtype=torch.bfloat16)


def test_non_finite_and_shape_mismatch_fail():
    ref = torch.ones(4, dtype=torch.float64)
    bad = ref.clone()
    bad[2] = float("nan")
    assert "non-finite" in accuracy_failure("x", bad, ref, ref, roundings=1)
    assert "shape" in accuracy_failure("x", ref[:3], ref, ref, roundings=1)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_accurate("x", bad, ref, ref, roundings=1)


def test_zero_reference_needs_the_terms_scale():
    """A result that is zero in exact arithmetic: a tiny error passes only at the terms' scale."""
    ref = torch.zeros(8, dtype=torch.float64)
    got = torch.full((8,), 1e-6, dtype=torch.float64)
    assert accuracy_failure("x", got, ref, ref, roundings=2, dtype=torch.float32)
    assert accuracy_failure("x", got, ref, ref, roundings=2, dtype=torch.float32, scale=10.0,
                            terms=4) is None


def test_a_chain_over_two_precisions_sums_their_roundings(seed):
    """roundings={bf16: 3, fp32: 1}: intermediates stored in bfloat16, the result in float32. The
    bound is 2 x (3 u(bf16) + u(fp32)) x scale: a float32 result that carries its bfloat16
    intermediates' rounding passes, one that is 3 times worse fails."""
    from accuracy import roundoff
    assert roundoff({torch.bfloat16: 3, torch.float32: 1}, torch.float32) == 3 * 2.0**-8 + 2.0**-24
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(64, generator=gen, dtype=torch.float64)
    exact = ref.clone()  # a baseline with no error: only the model counts
    chain = {torch.bfloat16: 3, torch.float32: 1}
    scale = ref.abs().max().item()
    ok = ref + 5.9 * 2.0**-8 * scale * (torch.rand(64, generator=gen, dtype=torch.float64) - 0.5)
    assert accuracy_failure("x", ok, exact, ref, roundings=chain) is None
    bad = ref.clone()
    bad[3] += 3 * 6.0 * 2.0**-8 * scale
    failure = accuracy_failure("x", bad, exact, ref, roundings=chain)
    assert failure and "3 x u(torch.bfloat16) + 1 x u(torch.float32)" in failure
