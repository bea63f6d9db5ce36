import os

import pytest
import torch


@pytest.fixture
def seed(request):
    """A fresh seed per test (TPF_SEED overrides it), printed when the test fails."""
    value = int(os.environ.get("TPF_SEED", torch.seed() % (2**31)))
    torch.manual_seed(value)
    yield value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "seed" in getattr(item, "funcargs", {}):
        report.sections.append(("seed", f"reproduce with TPF_SEED={item.funcargs['seed']}"))
