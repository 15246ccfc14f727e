"""Build (or find) the control-plane binaries.

Each binary is built once from pinned Go modules into ``<cache>/bin/<name>-<version>-<digest>/``
and reused from then on. Pre-installed binaries win: ``RINGWRIGHT_BIN_DIR`` or the envtest
convention ``KUBEBUILDER_ASSETS`` may point at a folder holding any of them.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .versions import COMPONENTS, GO_DIR, Component, cache_root

log = logging.getLogger("ringwright.devcluster.build")

OVERRIDE_VARS = ("RINGWRIGHT_BIN_DIR", "KUBEBUILDER_ASSETS")


class BuildError(RuntimeError):
    """A binary could not be found or built."""


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every binary the local control plane runs."""

    paths: dict[str, Path]

    def __getitem__(self, name: str) -> Path:
        return self.paths[name]


def _override(name: str) -> Path | None:
    for var in OVERRIDE_VARS:
        folder = os.environ.get(var)
        if folder and (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def cached_path(component: Component) -> Path:
    """Where ``component``'s build lives in the cache (it may not exist yet)."""
    return cache_root() / "bin" / component.key() / component.name


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "the Go toolchain is not on PATH; install Go 1.24+ (https://go.dev/doc/install) "
            "or point RINGWRIGHT_BIN_DIR at prebuilt kube-apiserver, kube-controller-manager, "
            "kube-scheduler, etcd, kwok and helm binaries"
        )
    return go


def _build(component: Component, dest: Path) -> None:
    ldflags = " ".join(("-s", "-w", *component.ldflags))
    tags = ["-tags", ",".join(component.tags)] if component.tags else []
    with tempfile.TemporaryDirectory(dir=dest.parent.parent) as tmp:
        out = Path(tmp) / component.name
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false"}
        if component.module_dir:
            cmd = [_go(), "build", "-trimpath", *tags, "-ldflags", ldflags, "-o", str(out),
                   component.package]
            cwd = GO_DIR / component.module_dir
        else:
            # `go install pkg@version` builds the upstream module as its own main module.
            cmd = [_go(), "install", "-trimpath", *tags, "-ldflags", ldflags, component.package]
            env["GOBIN"] = tmp
            cwd = Path(tmp)
        log.info("building %s %s (first run only; cached afterwards)", component.name,
                 component.version)
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(
                f"building {component.name} {component.version} failed "
                f"(cd {cwd} && {' '.join(cmd)}):\n{proc.stderr[-4000:]}"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out, dest)
        log.info("built %s in %.0fs -> %s", component.name, time.monotonic() - started, dest)


def ensure_binaries(names: tuple[str, ...] | None = None) -> Binaries:
    """Return every binary, building the missing ones; never rebuilds a cached one."""
    paths: dict[str, Path] = {}
    for component in COMPONENTS:
        if names is not None and component.name not in names:
            continue
        found = _override(component.name)
        if found is None:
            found = cached_path(component)
            if not found.is_file():
                found.parent.parent.mkdir(parents=True, exist_ok=True)
                _build(component, found)
        paths[component.name] = found
    return Binaries(paths)


def main() -> int:
    """Build or find every binary and list them (``make binaries``).

    Needs only the standard library, so it runs before the Python environment exists.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    started = time.monotonic()
    try:
        bins = ensure_binaries()
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for c in COMPONENTS:
        print(f"{c.name:<24} {c.version:<10} {bins[c.name]}")
    print(f"ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
