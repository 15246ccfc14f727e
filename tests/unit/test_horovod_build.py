"""scripts/build_horovod.sh's cache logic, against a stand-in venv whose `torch` is a
stub (no compiler, no network: a cached wheel must be found and used as is).

The Horovod it installs is exercised with real processes in
tests/runtime/test_horovod_gloo_env.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_horovod.sh"


# --------------------------------------------------------------- the script


def _fake_venv(root: Path, torch_version: str = "2.99.0+cpu", cplusplus: str = "202002L") -> Path:
    """A directory that looks like a venv whose torch is a stub package."""
    site = root / "site"
    torch_pkg = site / "torch"
    (torch_pkg / "include" / "ATen").mkdir(parents=True)
    (torch_pkg / "__init__.py").write_text(
        "raise ImportError('the script must not import torch')\n"
    )
    (torch_pkg / "version.py").write_text(
        f"__version__ = {torch_version!r}\ngit_version = '0123456789abcdef'\n"
    )
    (torch_pkg / "include" / "ATen" / "ATen.h").write_text(
        f"#if !defined(_MSC_VER) && __cplusplus < {cplusplus}\n#error too old\n#endif\n"
    )
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return venv


def _run(*args: str | Path, env: dict[str, str] | None = None,
         script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    full_env.update(env or {})
    return subprocess.run(
        ["bash", str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )


def test_script_parses_and_documents_itself() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    out = _run("--help")
    assert out.returncode == 0
    assert "Usage: scripts/build_horovod.sh" in out.stdout


def test_missing_venv_is_an_actionable_error(tmp_path: Path) -> None:
    out = _run(tmp_path / "nope", "--print-key")
    assert out.returncode != 0
    assert "no Python at" in out.stderr
    assert "create the venv first" in out.stderr


def test_cache_key_names_horovod_torch_python_and_the_recipe(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path)
    key = _run(venv, "--print-key").stdout.strip()
    py_tag = "cp{}{}".format(*sys.version_info[:2])
    assert key.startswith(f"horovod-0.28.1-torch-2.99.0+cpu-0123456789-{py_tag}-")
    # Another torch gives another key.
    other = _fake_venv(tmp_path / "b", torch_version="2.98.0+cpu")
    assert _run(other, "--print-key").stdout.strip() != key


def test_cache_key_covers_the_patches(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path)
    copy = tmp_path / "repo" / "scripts"
    (copy / "horovod-patches").mkdir(parents=True)
    (copy / "build_horovod.sh").write_text(SCRIPT.read_text())
    patches = sorted((SCRIPT.parent / "horovod-patches").glob("*.patch"))
    assert patches, "scripts/horovod-patches/ holds the patches the build applies"
    for patch in patches:
        (copy / "horovod-patches" / patch.name).write_text(patch.read_text())

    def key() -> str:
        return _run(venv, "--print-key", script=copy / "build_horovod.sh").stdout.strip()

    same = key()
    assert same == _run(venv, "--print-key").stdout.strip()
    changed = copy / "horovod-patches" / patches[0].name
    changed.write_text(changed.read_text() + "\n")
    assert key() != same


@pytest.mark.parametrize(("cplusplus", "standard"), [("202002L", 20), ("201703L", 17)])
def test_warm_run_uses_the_cached_wheel_without_building(
    tmp_path: Path, cplusplus: str, standard: int
) -> None:
    venv = _fake_venv(tmp_path, cplusplus=cplusplus)
    cache = tmp_path / "cache"
    key = _run(venv, "--print-key", "--cache", cache).stdout.strip()
    entry = cache / "wheels" / key
    entry.mkdir(parents=True)
    wheel = entry / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("horovod/__init__.py", "")
    out = _run(
        venv,
        "--cache",
        cache,
        "--no-install",
        "--wheel-dir",
        tmp_path / "out",
        env={"CI": "true", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "cached wheel found" in out.stdout
    assert "compile horovod" not in out.stdout
    assert f"headers need C++{standard}" in out.stdout
    assert (tmp_path / "out" / wheel.name).read_bytes() == wheel.read_bytes()
