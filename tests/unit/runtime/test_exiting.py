"""A training process freezes the collector's objects at exit, after the handlers
registered later have run."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import atexit, gc
atexit.register(lambda: print("at the end", gc.get_freeze_count() > 0))
from ringwright.runtime.exiting import freeze_objects_at_exit
freeze_objects_at_exit()
freeze_objects_at_exit()
atexit.register(lambda: print("first", gc.get_freeze_count() > 0))
print("handlers", atexit._ncallbacks())
"""


def test_objects_are_frozen_at_exit_once_after_later_handlers() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split("\n")
    # Registered once; the handler registered after it still sees the collector as usual.
    assert out[:3] == ["handlers 3", "first False", "at the end True"]
