"""The tests' shared operator is supervised as its Deployment would be: when it exits on
its own (it does when it cannot renew its Lease, e.g. while the API server stalls) it is
started again and takes the Lease back, so one stall does not leave every later test
without an operator; a test that kills or stops it keeps it down."""

from __future__ import annotations

import os
import signal

import pytest

from tests.jobs import OperatorProcess
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


def test_an_operator_that_exits_on_its_own_is_started_again_and_a_killed_one_is_not(
        operator: OperatorProcess) -> None:
    assert operator.supervised and operator.proc is not None
    before, restarts = operator.proc.pid, operator.restarts
    # As the operator exits itself on a lost Lease (os._exit(1)), seen from outside.
    os.kill(before, signal.SIGKILL)
    wait_for(lambda: operator.restarts == restarts + 1 and operator.proc is not None
             and operator.proc.pid != before and operator.proc.poll() is None,
             "the supervisor to start the operator again", timeout=30)

    operator.kill()
    try:
        with pytest.raises(AssertionError, match="timed out"):
            wait_for(lambda: operator.proc is not None, "a restart nobody asked for",
                     timeout=3)
        assert operator.restarts == restarts + 1
    finally:
        operator.start()
