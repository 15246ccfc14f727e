"""The pinned ``helm`` run against a local cluster, with helm's own folders kept apart
(no user repository, plugin or release cache leaks in or out)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .build import OVERRIDE_VARS, cached_path
from .versions import COMPONENTS

CHART = Path(__file__).resolve().parents[1] / "charts" / "ringwright"
"""The repository's chart."""


class HelmError(RuntimeError):
    """helm is missing or a helm command failed."""


def find_helm() -> Path | None:
    """The pinned helm (override folder, then build cache), else one on PATH."""
    for var in OVERRIDE_VARS:
        folder = os.environ.get(var)
        if folder and (Path(folder) / "helm").is_file():
            return Path(folder) / "helm"
    pinned = cached_path(next(c for c in COMPONENTS if c.name == "helm"))
    if pinned.is_file():
        return pinned
    found = shutil.which("helm")
    return Path(found) if found else None


@dataclass(frozen=True)
class Helm:
    """helm for the cluster of ``kubeconfig``; its config, cache and data under ``home``."""

    binary: Path
    kubeconfig: Path
    home: Path

    @classmethod
    def find(cls, kubeconfig: Path, home: Path) -> Helm | None:
        """helm for that cluster, or None where no helm binary is found."""
        binary = find_helm()
        return cls(binary, kubeconfig, home) if binary is not None else None

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``helm ARGS``, its output captured; never raises on a failed command."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "HELM_CONFIG_HOME": str(self.home / "helm-config"),
               "HELM_CACHE_HOME": str(self.home / "helm-cache"),
               "HELM_DATA_HOME": str(self.home / "helm-data")}
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True,
                              env=env, timeout=timeout, check=False)

    def check(self, *args: str, timeout: float = 300) -> str:
        """``helm ARGS``; its standard output. Raises :class:`HelmError` with helm's
        error output when the command fails."""
        proc = self.run(*args, timeout=timeout)
        if proc.returncode != 0:
            raise HelmError(f"helm {' '.join(args[:2])} failed (exit {proc.returncode}):\n"
                            f"{proc.stderr.strip()}")
        return proc.stdout
