"""Recovery, faults and joins: ringwright against torchrun and horovodrun elastic, on loopback.

Every system trains the same model on the same data with the same per-worker batch,
simulated compute per step, commit / checkpoint interval and collective timeout (but
``tr-detect``, below), and is timed the same way (``recovery_common`` defines every
interval once):

* SIGKILL: a node is lost (ringwright: the member's process; torchrun: its agent and
  worker together; horovodrun: its worker, and its host leaves discovery) -> the first
  step completed by a world of 3. Nobody learns of the death by ``waitpid`` of the
  victim: ringwright's stand-in operator waits for a survivor to notice, as on a cluster;
* SIGSTOP: a node freezes (no TCP reset) -> the first step at size 3;
* partition: a node's link is cut (packets dropped, no reset; every node in a network
  namespace of its own; horovodrun's driver too, in one beside them, reaching its hosts
  by ssh over the same links) -> the first step at size 3;
* straggler: one member pauses 30 s once -> rollbacks and steps lost (the goal is none);
* join: 2 members, scaled to 4 -> launch of the newcomers to the first step at size 4.

torchrun (``--nnodes=MIN:MAX --rdzv-backend=c10d``) runs three times: at its rendezvous
defaults, tuned (``last_call_timeout=1``, keep-alive 1 s x 3), and tuned with its
process-group timeout at ringwright's failure detection time (``tr-detect``: 3 s; a
straggler slower than that is then taken for dead). horovodrun runs twice: its host
discovery lists the inventory (``hvd``), or, as a careful user would set it up
(``hvd-probe``), drops a host whose worker does not answer a 1 s health probe, kills a
local worker that stops answering (:mod:`tests.bench.health_probe`), and its ssh has
keep-alives. A baseline that fails at what it is built for (training at full size before
a fault, SIGKILL recovery, join) makes the benchmark exit 1; a system that does not
survive a silent fault within its bound is reported as "not survived".

    python tests/bench/bench_recovery.py [--systems rw,tr,tr-tuned,tr-detect,rw-hvd,hvd,
                                         hvd-probe]
                                         [--scenarios sigkill,sigkill-rank0,sigstop,partition,
                                         straggler,join]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bench import (  # noqa: E402
    recovery_horovodrun,
    recovery_ringwright,
    recovery_torchrun,
)
from tests.bench.recovery_common import (  # noqa: E402
    DETECT_S,
    PG_TIMEOUT_S,
    STRAGGLER_S,
    Outcome,
)

Run = Callable[[Path], Outcome]
TUNED = recovery_torchrun.TUNED_RDZV

SYSTEMS = {
    "rw": "ringwright",
    "tr": "torchrun",
    "tr-tuned": "torchrun tuned",
    "tr-detect": f"torchrun, {DETECT_S:.0f} s timeout",
    "rw-hvd": "ringwright+hvd",
    "hvd": "horovodrun",
    "hvd-probe": "horovodrun, probed",
}
BASELINE_OF = {"tr": "rw", "tr-tuned": "rw", "tr-detect": "rw", "hvd": "rw-hvd",
               "hvd-probe": "rw-hvd"}
"""Which ringwright column each peer is compared with."""

SCENARIOS: dict[str, dict[str, Run]] = {
    "sigkill": {
        "rw": lambda d: recovery_ringwright.fault(d, signal.SIGKILL),
        "tr": lambda d: recovery_torchrun.fault(d, "", signal.SIGKILL),
        "tr-tuned": lambda d: recovery_torchrun.fault(d, TUNED, signal.SIGKILL),
        "tr-detect": lambda d: recovery_torchrun.fault(d, TUNED, signal.SIGKILL, DETECT_S),
        "rw-hvd": lambda d: recovery_ringwright.fault(d, signal.SIGKILL, backend="horovod"),
        "hvd": lambda d: recovery_horovodrun.fault(d, signal.SIGKILL),
        "hvd-probe": lambda d: recovery_horovodrun.fault(d, signal.SIGKILL, probe=True),
    },
    "sigkill-rank0": {
        # torchrun's store lives in its first agent: losing it ends a torchrun job.
        "rw": lambda d: recovery_ringwright.fault(d, signal.SIGKILL, victim=0),
    },
    "sigstop": {
        "rw": lambda d: recovery_ringwright.fault(d, signal.SIGSTOP),
        "tr": lambda d: recovery_torchrun.fault(d, "", signal.SIGSTOP),
        "tr-tuned": lambda d: recovery_torchrun.fault(d, TUNED, signal.SIGSTOP),
        "tr-detect": lambda d: recovery_torchrun.fault(d, TUNED, signal.SIGSTOP, DETECT_S),
        "rw-hvd": lambda d: recovery_ringwright.fault(d, signal.SIGSTOP, backend="horovod"),
        "hvd": lambda d: recovery_horovodrun.fault(d, signal.SIGSTOP),
        "hvd-probe": lambda d: recovery_horovodrun.fault(d, signal.SIGSTOP, probe=True),
    },
    "partition": {
        "rw": recovery_ringwright.partition,
        "tr": lambda d: recovery_torchrun.partition(d, ""),
        "tr-tuned": lambda d: recovery_torchrun.partition(d, TUNED),
        "tr-detect": lambda d: recovery_torchrun.partition(d, TUNED, DETECT_S),
        "rw-hvd": lambda d: recovery_ringwright.partition(d, backend="horovod"),
        "hvd": recovery_horovodrun.partition,
        "hvd-probe": lambda d: recovery_horovodrun.partition(d, probe=True),
    },
    "straggler": {
        "rw": recovery_ringwright.straggler,
        "tr": lambda d: recovery_torchrun.straggler(d, ""),
        "tr-tuned": lambda d: recovery_torchrun.straggler(d, TUNED),
        "tr-detect": lambda d: recovery_torchrun.straggler(d, TUNED, DETECT_S),
        "rw-hvd": lambda d: recovery_ringwright.straggler(d, backend="horovod"),
        "hvd": recovery_horovodrun.straggler,
        "hvd-probe": lambda d: recovery_horovodrun.straggler(d, probe=True),
    },
    "join": {
        "rw": recovery_ringwright.join,
        "tr": lambda d: recovery_torchrun.join(d, ""),
        "tr-tuned": lambda d: recovery_torchrun.join(d, TUNED),
        "tr-detect": lambda d: recovery_torchrun.join(d, TUNED, DETECT_S),
    },
}
TITLES = {
    "sigkill": "SIGKILL node 2 of 4 -> step at 3",
    "sigkill-rank0": "SIGKILL rank 0 (store) -> step at 3",
    "sigstop": "SIGSTOP node 2 of 4 -> step at 3",
    "partition": "partition node 2 of 4 -> step at 3",
    "straggler": f"straggler {STRAGGLER_S:.0f} s -> 10 more steps",
    "join": "join 2 -> 4, launch -> step at 4",
}


def cell(results: dict[str, Outcome | str], system: str) -> str:
    """Seconds, with the peer's ratio to its ringwright column."""
    got = results.get(system)
    if got is None:
        return "-"
    if isinstance(got, str):
        return got
    text = got.cell()
    base = results.get(BASELINE_OF.get(system, ""))
    if isinstance(base, Outcome) and base.seconds and got.seconds is not None:
        text += f" ({got.seconds / base.seconds:.1f}x)"
    return text


def report(table: dict[str, dict[str, Outcome | str]], systems: list[str]) -> None:
    """The figures, then the rollbacks and steps lost, then what each system did."""
    width = 30
    head = f"{'scenario':36}" + "".join(f"{SYSTEMS[s]:>{width}}" for s in systems)
    print(f"\ncollective timeout {PG_TIMEOUT_S:.0f} s for every system but "
          f"{SYSTEMS['tr-detect']!r} ({DETECT_S:.0f} s); torchrun tuned: {TUNED}"
          f"\n\n{head}\n{'-' * len(head)}")
    for name, results in table.items():
        print(f"{TITLES[name]:36}" + "".join(f"{cell(results, s):>{width}}" for s in systems))
    print(f"\n{'rollbacks / steps lost':36}" + "".join(f"{SYSTEMS[s]:>{width}}"
                                                       for s in systems))
    for name, results in table.items():
        row = []
        for s in systems:
            got = results.get(s)
            row.append(f"{got.rollbacks} / {got.steps_lost}" if isinstance(got, Outcome)
                       else "-")
        print(f"{TITLES[name]:36}" + "".join(f"{c:>{width}}" for c in row))
    print()
    for name, results in table.items():
        for s, got in results.items():
            if isinstance(got, Outcome):
                print(f"  {name} [{SYSTEMS[s]}]: {got.note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, from {','.join(SCENARIOS)}")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS] + \
        [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown: {unknown}")
    base = Path(tempfile.mkdtemp(prefix="ringwright-bench-"))
    print(f"workdir {base}; each scenario starts fresh processes", flush=True)
    table: dict[str, dict[str, Outcome | str]] = {}
    failed: list[str] = []
    for name in scenarios:
        table[name] = {}
        for system in systems:
            run = SCENARIOS[name].get(system)
            if run is None:
                continue
            print(f"{name} / {SYSTEMS[system]} ...", flush=True)
            try:
                table[name][system] = got = run(base / f"{name}-{system}")
                print(f"  {got.cell()}, rollbacks {got.rollbacks}, steps lost "
                      f"{got.steps_lost}: {got.note}", flush=True)
            except Exception as err:
                # A harness or baseline failure voids the comparison: exit 1 at the end.
                traceback.print_exc()
                table[name][system] = "FAILED"
                failed.append(f"{name}/{system}: {err}")
    report(table, systems)
    if failed:
        print("\nFAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
