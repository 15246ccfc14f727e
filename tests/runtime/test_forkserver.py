"""The fork server starts a worker as ``python script.py`` / ``python -m`` would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringwright.procstat import start_ticks
from ringwright.runtime.local.forkserver import (
    ForkedProcess,
    ForkServer,
    forkable,
    signal_group,
)
from tests.procstat import process_state
from tests.waiting import wait_for

CHILD = """
import json, os, random, sys, threading, time
import torch
import tests.seeds  # on PYTHONPATH only: the server's working directory, not the child's

def late():
    time.sleep(0.3)
    open("thread-done", "w").write("yes")

threading.Thread(target=late).start()  # not a daemon: the exit waits for it
json.dump({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("MARK"),
           "pid": os.getpid(), "pgid": os.getpgid(0), "draw": random.random(),
           "threads": torch.get_num_threads(), "path0": sys.path[0],
           "main": sys.modules["__main__"].__file__}, open("seen.json", "w"))
print("to stdout"); print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer()
    yield s
    s.close()


def _spawn(server: ForkServer, tmp_path: Path, argv: list[str], name: str,
           **env: str) -> ForkedProcess:
    work = tmp_path / name
    work.mkdir()
    with (work / "out.log").open("wb") as out, (work / "err.log").open("wb") as err:
        return server.spawn(argv, {**os.environ, **env}, stdout=out.fileno(),
                            stderr=err.fileno(), cwd=str(work))


def test_a_script_runs_as_its_own_main_program(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    first = server.spawn([sys.executable, str(script), "3", "x"],
                         {**os.environ, "MARK": "one", "OMP_NUM_THREADS": "1",
                          "PYTHONPATH": os.getcwd()},
                         stdout=os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT),
                         stderr=os.open(tmp_path / "err", os.O_WRONLY | os.O_CREAT),
                         cwd=str(tmp_path))
    assert first.wait(timeout=60) == 3
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["argv"] == [str(script), "3", "x"]
    assert seen["cwd"] == str(tmp_path) and seen["env"] == "one" and seen["pid"] == first.pid
    assert seen["path0"] == str(tmp_path) and seen["main"] == str(script)
    assert seen["threads"] == 1  # the child's OMP_NUM_THREADS, not the server's
    assert seen["pgid"] != first.pid  # no session asked for
    assert (tmp_path / "thread-done").read_text() == "yes"
    assert (tmp_path / "out").read_text() == "to stdout\n"
    assert (tmp_path / "err").read_text() == "to stderr\n"

    # A second child draws its own random numbers and may lead its own session.
    second = _spawn(server, tmp_path, [sys.executable, str(script), "0"], "second",
                    MARK="two", PYTHONPATH=os.getcwd())
    assert second.wait(timeout=60) == 0
    other = json.loads((tmp_path / "second" / "seen.json").read_text())
    assert other["env"] == "two" and other["draw"] != seen["draw"]


def test_modules_sessions_signals_and_errors(server: ForkServer, tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    # The server's own working directory is on PYTHONPATH too: it must stay on the path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    with (tmp_path / "log").open("wb") as log:
        sleeper = server.spawn([sys.executable, "-m", "sleeper"], env, stdout=log.fileno(),
                               stderr=log.fileno(), cwd=str(tmp_path), new_session=True)
        broken = server.spawn([sys.executable, "-m", "broken"], env, stdout=log.fileno(),
                              stderr=log.fileno(), cwd=str(tmp_path))
    assert broken.wait(timeout=60) == 1
    assert "RuntimeError: broken on purpose" in (tmp_path / "log").read_text()
    assert os.getpgid(sleeper.pid) == sleeper.pid  # leads its own process group
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    os.killpg(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(timeout=60) == -signal.SIGKILL


EXITS = {
    # A file left open is flushed, atexit handlers run, in the order Python runs them
    # (the function makes the namespace a cycle: only a collection frees it).
    "unclosed": "import atexit, sys\n"
                "out = open('left-open', 'w'); out.write('all of it')\n"
                "def main(): pass\n"
                "atexit.register(lambda: open('atexit', 'w').write(str(out.closed)))\n"
                "sys.exit(4)\n",
    "message": "import sys\nsys.exit('no data here: give DATA_DIR')\n",
    "interrupted": "raise KeyboardInterrupt\n",
    "returns": "x = 1\n",
    # An idle thread-pool worker is told to end; a non-daemon thread is waited for.
    "threads": "import threading, time\n"
               "from concurrent.futures import ThreadPoolExecutor\n"
               "pool = ThreadPoolExecutor(1); pool.submit(int).result()\n"
               "def late(): time.sleep(0.2); open('late', 'w').write('joined')\n"
               "threading.Thread(target=late).start()\n",
}


def test_a_child_ends_as_the_interpreter_would(server: ForkServer, tmp_path: Path) -> None:
    # The child skips the teardown of the server's modules (slow), not what a program sees.
    codes = {}
    for name, text in EXITS.items():
        (tmp_path / f"{name}.py").write_text(text)
        child = _spawn(server, tmp_path, [sys.executable, str(tmp_path / f"{name}.py")], name)
        codes[name] = child.wait(timeout=60)
    assert codes == {"unclosed": 4, "message": 1, "interrupted": -signal.SIGINT,
                     "returns": 0, "threads": 0}
    assert (tmp_path / "threads" / "late").read_text() == "joined"
    assert (tmp_path / "unclosed" / "left-open").read_text() == "all of it"
    assert (tmp_path / "unclosed" / "atexit").read_text() == "False"  # before the teardown
    assert (tmp_path / "message" / "err.log").read_text() == "no data here: give DATA_DIR\n"
    assert "KeyboardInterrupt" in (tmp_path / "interrupted" / "err.log").read_text()


def assert_ends(pid: int, started: int | None, why: str) -> None:
    """Fail unless process ``pid``, started at ``started`` (clock ticks; a session leader),
    has ended within 30 s; kill its group if it has not.

    Ended: gone, a zombie (init reaps orphans every couple of seconds here), or its pid
    taken by a process started since. The suite starts processes and threads fast enough
    for the pids to wrap around within the wait: a bare ``kill(pid, 0)`` once found a
    new process under the killed child's pid."""
    assert started is not None, f"child {pid} was gone before its start could be read"

    def ended() -> bool:
        return start_ticks(pid) != started or process_state(pid) == "Z"

    try:
        wait_for(ended, f"child {pid} to end ({why})", timeout=30, interval=0.05)
    except AssertionError as err:
        state = process_state(pid)
        if start_ticks(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        raise AssertionError(f"{err}; its state: {state}") from None


@pytest.mark.parametrize("ending", ["closed", signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_server_that_ends_kills_its_children(tmp_path: Path,
                                                ending: str | signal.Signals) -> None:
    # Closed by the launcher, or signalled with the launcher's process group (a Ctrl-C, a
    # kill): a child in a session of its own is out of that group's reach. A server
    # SIGKILLed (the OOM killer) takes no child with it: this side kills them. Either
    # way a waiter learns that the child is gone.
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    server = ForkServer(preload=())
    with (tmp_path / "log").open("wb") as log:
        child = server.spawn([sys.executable, str(tmp_path / "sleeper.py")], dict(os.environ),
                             stdout=log.fileno(), stderr=log.fileno(), new_session=True)
    if isinstance(ending, signal.Signals):
        os.kill(server._proc.pid, ending)
        assert server._proc.wait(timeout=30) == -ending  # it ends as the signal would
    else:
        server.close()
    try:
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        server.close()
    assert_ends(child.pid, child.started, "its fork server ended")


SLOW_SETSID = """import os, time
_setsid = os.setsid
def setsid():  # the child, before it leads a session of its own
    time.sleep(3)
    return _setsid()
os.setsid = setsid
"""


def test_a_child_killed_before_it_made_its_session_is_killed_all_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a loaded machine a child may not have run at all when its server is SIGKILLed:
    # it has no process group of its own yet, and a kill of that group finds none.
    (tmp_path / "slowsetsid.py").write_text(SLOW_SETSID)
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    server = ForkServer(preload=("slowsetsid",))
    with (tmp_path / "log").open("wb") as log:
        child = server.spawn([sys.executable, str(tmp_path / "sleeper.py")], dict(os.environ),
                             stdout=log.fileno(), stderr=log.fileno(), new_session=True)
    try:
        os.kill(server._proc.pid, signal.SIGKILL)
        assert server._proc.wait(timeout=30) == -signal.SIGKILL
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        server.close()
    assert_ends(child.pid, child.started, "its fork server was SIGKILLed before its setsid")


def test_a_signal_to_a_group_reaches_its_leader_before_it_leads_one() -> None:
    # A process of no group of its own (a child yet to call setsid) gets it alone...
    alone = subprocess.Popen(["sleep", "60"])
    signal_group(alone.pid, signal.SIGKILL)
    assert alone.wait(timeout=30) == -signal.SIGKILL
    # ...and a session leader's whole group gets it, its children too.
    leader = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"], text=True,
                              stdout=subprocess.PIPE, start_new_session=True)
    assert leader.stdout is not None
    sleeper = int(leader.stdout.readline())
    started = start_ticks(sleeper)
    signal_group(leader.pid, signal.SIGKILL)
    assert leader.wait(timeout=30) == -signal.SIGKILL
    assert_ends(sleeper, started, "its group was signalled")


SLOW_FORK = """import os, pathlib, time
_fork = os.fork
def fork():
    pid = _fork()
    if pid:  # the server, before it has recorded its new child
        pathlib.Path(os.environ["FORKED_MARK"]).write_text(str(pid))
        time.sleep(2)
    return pid
os.fork = fork
"""


def test_a_signal_that_comes_while_a_child_is_forked_kills_that_child_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's fork is slowed (a module it preloads) so that the signal comes between
    # the fork and the server's record of the child.
    (tmp_path / "slowfork.py").write_text(SLOW_FORK)
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    mark = tmp_path / "forked"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("FORKED_MARK", str(mark))
    server = ForkServer(preload=("slowfork",))

    def spawn() -> None:
        with (tmp_path / "log").open("wb") as log, contextlib.suppress(RuntimeError):
            server.spawn([sys.executable, str(tmp_path / "sleeper.py")], dict(os.environ),
                         stdout=log.fileno(), stderr=log.fileno(), new_session=True)

    spawning = threading.Thread(target=spawn)
    spawning.start()
    try:
        child = int(wait_for(lambda: mark.read_text() if mark.exists() else None,
                             "the server to fork", interval=0.01))
        started = start_ticks(child)  # alive: the server sleeps before it records it
        os.kill(server._proc.pid, signal.SIGTERM)
        assert server._proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        spawning.join(timeout=30)
        server.close()
    assert_ends(child, started, "its fork server was signalled as it forked the child")


@pytest.mark.parametrize(("argv", "expected"), [
    ([sys.executable, "train.py", "--lr", "1"], True),
    ([sys.executable, "-m", "ringwright.runtime.launch", "--", "x"], True),
    ([sys.executable, "-m"], False),
    ([sys.executable, "-u", "train.py"], False),  # an interpreter option
    (["/bin/echo", "hi"], False),
    ([sys.executable], False),
])
def test_only_this_interpreters_plain_commands_are_forked(argv: list[str],
                                                           expected: bool) -> None:
    assert forkable(argv) is expected


RANK = """\
import os, pathlib, signal, sys, time
k = os.environ["LOCAL_RANK"]
out = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    time.sleep(0.3)  # a checkpoint being written
    (out / f"flushed{k}").touch()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(out / f"ready{k}").write_text("forked" if "torch" in sys.modules else "exec'd")
time.sleep(600)
"""


def test_the_pod_entry_point_forks_its_ranks_and_the_pods_sigterm_lets_them_checkpoint(
        tmp_path: Path) -> None:
    """With RINGWRIGHT_FORK_WORKERS=1 a pod of three ranks forks them from one server that
    imported torch; a SIGTERM to the pod's process group (what the pod host sends) reaches
    each rank's own handler, which writes its checkpoint and exits 0: the server, in the
    same group, does not kill them on it."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "RINGWRIGHT_PROCS_PER_POD": "3", "RINGWRIGHT_FORK_WORKERS": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    pod = subprocess.Popen([sys.executable, "-m", "ringwright.runtime.launch", "--",
                            sys.executable, str(script), str(tmp_path)],
                           env=env, start_new_session=True)
    try:
        wait_for(lambda: all((tmp_path / f"ready{k}").exists() for k in range(3)),
                 "the pod's three ranks to start", timeout=120)
        assert {(tmp_path / f"ready{k}").read_text() for k in range(3)} == {"forked"}
        os.killpg(pod.pid, signal.SIGTERM)
        assert pod.wait(timeout=60) == 0
        assert sorted(p.name for p in tmp_path.glob("flushed*")) == [
            "flushed0", "flushed1", "flushed2"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pod.pid, signal.SIGKILL)
