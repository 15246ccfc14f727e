"""Freed transport buffers stay in the process: the settings, and their effect on page faults."""

from __future__ import annotations

import subprocess
import sys

from ringwright.runtime.ps import memory


class FakeMallopt(memory.Mallopt):
    def __init__(self, available: bool = True, refuse: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self._available, self._refuse = available, refuse

    @property
    def available(self) -> bool:
        return self._available

    def __call__(self, param: int, value: int) -> bool:
        self.calls.append((param, value))
        return param != self._refuse


def test_the_trim_threshold_is_the_retained_bytes_and_small_buffers_come_from_the_heap() -> None:
    fake = FakeMallopt()
    assert memory.retain_freed_memory(256 << 20, fake)
    assert dict(fake.calls) == {memory.M_MMAP_THRESHOLD: 32 << 20,
                                memory.M_TRIM_THRESHOLD: 256 << 20,
                                memory.M_TOP_PAD: memory.TOP_PAD_BYTES,
                                memory.M_ARENA_MAX: 2}
    clamped = FakeMallopt()
    memory.retain_freed_memory(8 << 30, clamped)
    assert dict(clamped.calls)[memory.M_TRIM_THRESHOLD] == (1 << 31) - 1  # an int in C


def test_without_mallopt_or_with_a_refusal_nothing_fails() -> None:
    absent = FakeMallopt(available=False)
    assert not memory.retain_freed_memory(mallopt=absent)
    assert absent.calls == []
    assert not memory.retain_freed_memory(mallopt=FakeMallopt(refuse=memory.M_TOP_PAD))


# Frees 16 buffers of 8 MB (what a chunked 128 MB transfer leaves) and writes them again:
# the page faults of the second round are the memory given back and faulted in again.
ROUNDS = """
import resource, sys
from ringwright.runtime.ps.memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def round_():
    bufs = [b"\\x01" * (8 << 20) for _ in range(16)]
    del bufs
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], check=True,
                         capture_output=True, text=True)
    return int(out.stdout)


def test_a_second_transfer_reuses_the_memory_of_the_first() -> None:
    pages = (16 * (8 << 20)) // 4096
    assert _second_round_faults("default") > pages // 2  # glibc gave it back
    assert _second_round_faults("retain") < pages // 10
