"""Seeds for every test (CPU and GPU), and the accuracy sweep's parametrization.

Every test runs with torch's, numpy's and Python's global generators seeded, and the `seed` fixture
hands the same value to tests that draw their own generators, so module constructors, inputs and
dropout masks are reproducible. The seed:
- by default, fixed per test (a hash of its id): CI and every fresh clone see the same inputs;
- TPF_SEED=<integer>: that seed for every test (what a failure report prints to reproduce it);
- TPF_SEED=random: a fresh seed per test, for hunting inputs that fail (printed on failure).
`--seeds K` (tests/sweep_accuracy.py) runs each test that takes `seed` under K seeds, starting at
TPF_SEED when it is an integer.
"""
from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "python"))
import seeds  # noqa: E402
from seeds import seed_for, sweep_start, without_seed_id  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--seeds", type=int, default=0,
                     help="run each test that takes `seed` under this many seeds (accuracy sweeps)")
    parser.addoption("--only-tests", default=None,
                     help="a file of test ids, one a line: run only those (under every seed)")


def pytest_collection_modifyitems(config, items):
    listed = config.getoption("--only-tests")
    if not listed:
        return
    with open(listed) as f:
        wanted = {line.strip() for line in f if line.strip()}
    keep = [item for item in items if without_seed_id(item.nodeid) in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def pytest_generate_tests(metafunc):
    count = metafunc.config.getoption("--seeds")
    if count and "seed" in metafunc.fixturenames:
        start = sweep_start()
        metafunc.parametrize("seed", [start + i for i in range(count)], indirect=True,
                             ids=[f"seed{start + i}" for i in range(count)])


def _test_seed(node) -> int:
    callspec = getattr(node, "callspec", None)
    if callspec is not None and "seed" in callspec.params:
        return int(callspec.params["seed"])
    try:
        return seed_for(node.nodeid)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.fixture(autouse=True)
def _seeded(request):
    value = _test_seed(request.node)
    request.node.tpf_seed = value
    torch.manual_seed(value)
    np.random.seed(value % 2**32)
    random.seed(value)
    seeds.current = value
    yield value


@pytest.fixture
def seed(request, _seeded):
    """The test's seed (see the module docstring)."""
    return _seeded


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    value = getattr(item, "tpf_seed", None)
    if report.failed and value is not None:
        report.sections.append(
            ("seed", f"reproduce with: TPF_SEED={value} pytest '{without_seed_id(item.nodeid)}'"))
