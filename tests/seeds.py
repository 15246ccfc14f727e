"""One seed per test run, and from it one per test, so a randomised run can be replayed.

The run's seed is ``RINGWRIGHT_TEST_SEED`` when set, otherwise drawn once per run (the
controller draws it before pytest-xdist starts its workers, which inherit it). Each
test's seed is derived from the run's seed and the test's id, so it does not depend on
which worker ran the test or in what order: ``RINGWRIGHT_TEST_SEED=N pytest <test id>``
replays the randomness of that test in the run that printed ``seed=N``.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

SEED_VAR = "RINGWRIGHT_TEST_SEED"
"""The environment variable that fixes the run's seed."""


def run_seed() -> int:
    """The run's seed: ``RINGWRIGHT_TEST_SEED``, or a fresh one stored there for the
    processes this one starts (pytest-xdist's workers among them)."""
    text = os.environ.get(SEED_VAR, "").strip()
    if text:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{SEED_VAR}={text!r}: expected an integer (the seed=N a "
                             "run printed)") from None
    seed = random.SystemRandom().randrange(2**32)
    os.environ[SEED_VAR] = str(seed)
    return seed


def seed_of_test(run: int, test_id: str) -> int:
    """The seed of one test: a function of the run's seed and the test's id only."""
    digest = hashlib.sha256(f"{run}:{test_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")



def seed_generators(seed: int) -> None:
    """Seed the global generators a test may draw from without seeding them itself:
    ``random``, and numpy's and torch's when the test process has imported them
    (importing torch here would cost every unit test seconds)."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
