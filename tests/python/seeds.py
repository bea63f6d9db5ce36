"""The suite's seeds (tests/conftest.py documents the modes): TPF_SEED unset, an integer, or
"random"."""
from __future__ import annotations

import os
import random
import zlib
from typing import Optional

# The running test's seed: tests/conftest.py sets it per test, distributed_checks.py per rank, and
# accuracy.py logs it with each check (tests/sweep_accuracy.py reads the log). Not an input: what
# users set is TPF_SEED.
current: Optional[int] = None


def seed_for(key: str) -> int:
    """The seed of the test (or module-scoped fixture) named `key`: fixed per key by default, the
    value of TPF_SEED when it is an integer, fresh when it is "random"."""
    env = os.environ.get("TPF_SEED", "").strip()
    if env == "random":
        return random.SystemRandom().randrange(2**31)
    if env:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"TPF_SEED must be an integer or 'random', got {env!r}") from None
    return zlib.crc32(key.encode()) % 2**31


def sweep_start() -> int:
    """The first seed of a `--seeds K` sweep: TPF_SEED when it is an integer, else 0."""
    env = os.environ.get("TPF_SEED", "").strip()
    return int(env) if env.lstrip("-").isdigit() else 0


def without_seed_id(nodeid: str) -> str:
    """A test's id without the `seedN` parameter that `--seeds` adds."""
    head, sep, params = nodeid.partition("[")
    if not sep:
        return nodeid
    kept = [p for p in params.rstrip("]").split("-") if not p.startswith("seed")]
    return f"{head}[{'-'.join(kept)}]" if kept else head
