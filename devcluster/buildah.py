"""Calling buildah, and telling the user which tools the images need."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

INSTALL = "apt-get update && apt-get install -y buildah mmdebstrap runc podman"
"""What installs the tools (Debian/Ubuntu, as root). podman only runs the image tests."""

RUNTIME = "runc"
"""The OCI runtime for every container: crun refuses hybrid cgroup (v1 + v2) hosts."""


class ImageError(RuntimeError):
    """An image could not be made."""


def require(*tools: str) -> None:
    """Raise :class:`ImageError` naming the install command if any of ``tools`` is
    missing."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise ImageError(f"{', '.join(missing)} not found: the images are built without "
                         f"Docker, with buildah and mmdebstrap; install them: {INSTALL}")


def run(*args: str, log: Path | None = None) -> str:
    """Run ``buildah *args`` and return its stdout; with ``log``, its stdout and stderr
    go to that file instead and an error quotes the file's end."""
    cmd = ["buildah", *args]
    if log is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise ImageError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-4000:]}")
        return proc.stdout
    with log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise ImageError(f"{' '.join(cmd[:3])} ... failed (exit {code}); its end, full "
                         f"log in {log}:\n{tail}")
    return ""


def image_id(ref: str) -> str | None:
    """The ID of local image ``ref``, or None when there is none."""
    proc = subprocess.run(["buildah", "inspect", "--type", "image", "--format",
                           "{{.FromImageID}}", ref], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def tags(repository: str) -> list[str]:
    """The tags of local ``repository`` (e.g. ``localhost/ringwright/training``)."""
    out = run("images", "--format", "{{.Name}}:{{.Tag}}")
    return sorted(line.rsplit(":", 1)[1] for line in out.split()
                  if line.rsplit(":", 1)[0] == repository)


def layers(ref: str) -> list[str]:
    """The diff IDs of the layers of local image ``ref``, base first."""
    return run("inspect", "--type", "image", "--format",
               "{{range .OCIv1.RootFS.DiffIDs}}{{.}} {{end}}", ref).split()


def images() -> list[tuple[str, list[str]]]:
    """Every local image, intermediate ones included: (ID, names)."""
    return [(i["id"], list(i["names"] or [])) for i in json.loads(run("images", "-a", "--json"))]
