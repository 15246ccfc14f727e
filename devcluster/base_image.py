"""The base image of the project's images, made from Debian packages without a registry.

``mmdebstrap`` installs Debian bookworm with Python 3.11, pip, venv, passwd (groupadd,
useradd) and ca-certificates into a tarball, which becomes a one-layer image in
buildah's local storage. It stands in for the public ``python:3.11-slim-bookworm``
that the Dockerfile names for Docker users: ``python`` and ``pip`` are on PATH
(python-is-python3; pip from python3-pip), and manuals, docs and translations are left
out as the Debian slim images do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from . import buildah
from .buildah import ImageError

log = logging.getLogger("ringwright.devcluster.base_image")

REPOSITORY = "localhost/ringwright/python"
MERGED_USR_HOOKS = "/usr/share/mmdebstrap/hooks/merged-usr"
"""mmdebstrap's hooks that lay out /bin -> usr/bin as Debian's images do; without them
init-system-helpers pulls in usrmerge and with it perl."""


@dataclass(frozen=True)
class Recipe:
    """Everything that decides what the base image holds."""

    suite: str
    tag: str
    sources: tuple[str, ...]
    packages: tuple[str, ...]
    dpkg_options: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    def digest(self) -> str:
        """sha256 of the recipe: a changed recipe is another image."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def reference(self) -> str:
        """The image's name in local storage, e.g.
        ``localhost/ringwright/python:3.11-bookworm-<digest>``."""
        return f"{REPOSITORY}:{self.tag}-{self.digest()[:12]}"

    def mmdebstrap_command(self, tarball: Path) -> list[str]:
        """The command that writes the root filesystem to ``tarball``."""
        return ["mmdebstrap", "--variant=minbase", f"--hook-dir={MERGED_USR_HOOKS}",
                "--include=" + ",".join(self.packages),
                *(f"--dpkgopt={o}" for o in self.dpkg_options),
                self.suite, str(tarball), *self.sources]


RECIPE = Recipe(
    suite="bookworm",
    tag="3.11-bookworm",
    sources=("deb http://deb.debian.org/debian bookworm main",
             "deb http://deb.debian.org/debian bookworm-updates main",
             "deb http://deb.debian.org/debian-security bookworm-security main"),
    packages=("python3", "python3-pip", "python3-venv", "python-is-python3", "passwd",
              "ca-certificates"),
    dpkg_options=("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
                  "path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                  "path-exclude=/usr/share/locale/*"),
    env=(("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
         ("LANG", "C.UTF-8")),
)


def ensure(workdir: Path, recipe: Recipe = RECIPE) -> str:
    """The reference of ``recipe``'s image, made first when local storage lacks it
    (about two minutes: the packages are downloaded from the Debian mirror)."""
    ref = recipe.reference()
    if buildah.image_id(ref) is not None:
        return ref
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".base-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        log_path = workdir / "base-mmdebstrap.log"
        log.info("making the Debian base image %s with mmdebstrap (log: %s)", ref, log_path)
        with log_path.open("w") as out:
            code = subprocess.run(recipe.mmdebstrap_command(tarball), stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                                  ).returncode
        if code != 0:
            tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-30:])
            raise ImageError(f"mmdebstrap failed (exit {code}); can this machine reach "
                             f"deb.debian.org? Its log ends:\n{tail}")
        container = buildah.run("from", "scratch").strip()
        try:
            buildah.run("add", container, str(tarball), "/")
            config = [f"--env={k}={v}" for k, v in recipe.env]
            buildah.run("config", *config, "--cmd", '["python3"]',
                        "--label", f"dev.ringwright.base.recipe={recipe.digest()}", container)
            buildah.run("commit", "--quiet", container, ref)
        finally:
            buildah.run("rm", container)
    buildah.run("tag", ref, f"{REPOSITORY}:{recipe.tag}")
    return ref
