"""Container images of ringwright, built with buildah: no Docker engine, no registry.

    python -m ringwright.devcluster.images build [--target operator|training|training-horovod|all]

Each target of the Dockerfile is built on the Debian base of :mod:`.base_image`, from
the wheels of the project's venv (:mod:`.wheelhouse`; the horovod image gets the wheel
``scripts/build_horovod.sh`` built into ``<cache>/wheels/``), with no network in its
RUN steps, and exported as an OCI archive that ``ctr images import`` takes:
``<cache>/images/<target>-<key>.tar``. The key is a digest of everything that goes into
the image (the Dockerfile, the build context as ``.dockerignore`` selects it, the base
recipe, the wheels), like the binaries' ``<cache>/bin/<name>-<version>-<digest>``: with
nothing changed, a build only finds its image and archive (seconds). A new key replaces
the target's older image tag and archive.
"""

from __future__ import annotations

import argparse
import email.parser
import fcntl
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import base_image, buildah, wheelhouse
from .build_context import context_files, digest_files
from .buildah import RUNTIME, ImageError
from .versions import cache_root
from .wheelhouse import Installed, WheelhouseError

log = logging.getLogger("ringwright.devcluster.images")

ROOT = Path(__file__).resolve().parents[1]
"""The checkout: the Dockerfile and the build context."""
HOROVOD_SCRIPT = ROOT / "scripts" / "build_horovod.sh"


@dataclass(frozen=True)
class Target:
    """One image: a target of the Dockerfile."""

    name: str
    repository: str
    tag_suffix: str
    """After the project version: ``0.1.0-horovod``."""
    extras: tuple[str, ...]
    """The project's optional dependencies it installs."""
    horovod: bool = False


TARGETS = {t.name: t for t in (
    Target("operator", "ringwright/operator", "", ()),
    Target("training", "ringwright/training", "", ("runtime",)),
    Target("training-horovod", "ringwright/training", "-horovod", ("runtime",), horovod=True),
)}


@dataclass(frozen=True)
class Plan:
    """What one build puts into an image, and the names its result goes by."""

    target: Target
    version: str
    wheels: tuple[Installed, ...]
    horovod_wheel: Path | None
    horovod_wheels: tuple[Installed, ...]
    """What the Horovod wheel depends on."""
    key: str

    @property
    def tag(self) -> str:
        """``0.1.0`` or ``0.1.0-horovod``: the tag the manifests use."""
        return self.version + self.target.tag_suffix

    @property
    def name(self) -> str:
        """The image's name in local storage."""
        return f"localhost/{self.target.repository}:{self.tag}"

    @property
    def keyed_name(self) -> str:
        """The name of exactly this build."""
        return f"localhost/{self.target.repository}:{self.tag}-{self.key[:12]}"

    @property
    def archive_reference(self) -> str:
        """The name the archive gives the image: a kubelet's pod spec that says
        ``ringwright/training:0.1.0`` finds it once containerd imported the archive."""
        return f"docker.io/{self.target.repository}:{self.tag}"

    def archive(self, cache: Path) -> Path:
        """Where the OCI archive of this build lives."""
        return cache / "images" / f"{self.target.name}-{self.key[:12]}.tar"


@dataclass(frozen=True)
class BuiltImage:
    """An image in buildah's local storage and its OCI archive."""

    target: str
    names: tuple[str, ...]
    image_id: str
    archive: Path
    built: bool
    """False when the cache already had it."""


def pyproject() -> dict[str, Any]:
    """The checkout's pyproject.toml."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def roots(target: Target, project: dict[str, Any]) -> list[str]:
    """The requirements the image installs from wheels: the project's dependencies,
    the target's extras (less Horovod, which has a wheel of its own) and what building
    the project's wheel needs."""
    meta = project["project"]
    found = [*meta["dependencies"], *project["build-system"]["requires"]]
    for extra in target.extras:
        found.extend(meta["optional-dependencies"][extra])
    return found


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    return meta.get_all("Requires-Dist") or []


def horovod_wheel(venv: Path, cache: Path) -> Path:
    """The Horovod wheel built against ``venv``'s torch, from the cache of
    ``scripts/build_horovod.sh`` (which builds it first when missing: minutes)."""
    common = ["bash", str(HOROVOD_SCRIPT), "--venv", str(venv), "--cache", str(cache)]

    def script(*args: str) -> str:
        proc = subprocess.run([*common, *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise ImageError(f"{HOROVOD_SCRIPT.name} {' '.join(args)} failed:\n"
                             f"{proc.stderr[-4000:]}")
        return proc.stdout

    key = script("--print-key").strip()
    found = sorted((cache / "wheels" / key).glob("horovod-*.whl"))
    if not found:
        log.info("no Horovod wheel for this venv yet: building it (make env does too)")
        script("--no-install", "--no-smoke")
        found = sorted((cache / "wheels" / key).glob("horovod-*.whl"))
    return found[0]


def plan(target: Target, venv: Path, cache: Path) -> Plan:
    """Everything ``target``'s image is made of, and its key."""
    project = pyproject()
    dists = wheelhouse.installed(wheelhouse.site_packages(venv))
    wheels = wheelhouse.closure(roots(target, project), dists, venv, leave_out=["horovod"])
    hvd_wheel, hvd_wheels = None, []
    if target.horovod:
        hvd_wheel = horovod_wheel(venv, cache)
        hvd_wheels = wheelhouse.closure(_wheel_requires(hvd_wheel), dists, venv)
    parts = {
        "target": target.name,
        "dockerfile": hashlib.sha256((ROOT / "Dockerfile").read_bytes()).hexdigest(),
        "context": digest_files(ROOT, context_files(ROOT)),
        "base": base_image.RECIPE.digest(),
        "wheels": wheelhouse.set_digest(wheels),
        "horovod": wheelhouse.set_digest(hvd_wheels, [hvd_wheel]) if hvd_wheel else "",
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return Plan(target, project["project"]["version"], tuple(wheels), hvd_wheel,
                tuple(hvd_wheels), key)


def bud_args(p: Plan, base: str, wheels: str, horovod: str, context: Path) -> list[str]:
    """The ``buildah bud`` arguments of a build: ``base`` is the base image, ``wheels``
    and ``horovod`` (or "") folders and a wheel of the ``context`` wheelhouse."""
    args = ["bud", "--layers", "--network", "none", "--runtime", RUNTIME,
            "--target", p.target.name, "-f", str(ROOT / "Dockerfile"),
            "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"WHEELHOUSE={wheels}",
            "--build-context", f"wheelhouse={context}", "-t", p.name, "-t", p.keyed_name]
    if horovod:
        args += ["--build-arg", f"HOROVOD_WHEEL={horovod}"]
    return [*args, str(ROOT)]


def _cached(p: Plan, cache: Path) -> BuiltImage | None:
    image = buildah.image_id(p.keyed_name)
    if image is None or not p.archive(cache).is_file():
        return None
    if buildah.image_id(p.name) != image:  # the moving tag went elsewhere: point it back
        buildah.run("tag", p.keyed_name, p.name)
    return BuiltImage(p.target.name, (p.name, p.keyed_name), image, p.archive(cache), False)


def _prune(p: Plan, cache: Path) -> None:
    """Drop the target's older keyed tags and archives."""
    repository = f"localhost/{p.target.repository}"
    older = re.compile(re.escape(p.tag) + r"-[0-9a-f]{12}")
    for tag in buildah.tags(repository):
        if older.fullmatch(tag) and f"{repository}:{tag}" != p.keyed_name:
            buildah.run("rmi", f"{repository}:{tag}")
    for archive in (cache / "images").glob(f"{p.target.name}-*.tar"):
        if archive != p.archive(cache) and re.fullmatch(
                re.escape(p.target.name) + r"-[0-9a-f]{12}\.tar", archive.name):
            archive.unlink()


def _build(p: Plan, cache: Path) -> BuiltImage:
    images = cache / "images"
    base = base_image.ensure(images)
    root = cache / "wheelhouse"
    wheels = wheelhouse.ensure_set(root, p.wheels)
    horovod = ""
    if p.horovod_wheel is not None:
        folder = wheelhouse.ensure_set(root, p.horovod_wheels, [p.horovod_wheel])
        horovod = f"{folder.name}/{p.horovod_wheel.name}"
    build_log = images / f"{p.target.name}.log"
    log.info("building %s (log: %s)", p.keyed_name, build_log)
    buildah.run(*bud_args(p, base, wheels.name, horovod, root), log=build_log)
    archive = p.archive(cache)
    part = archive.with_suffix(".part")
    part.unlink(missing_ok=True)
    # zstd: half the time of gzip on the gigabytes of torch (buildah's oci-archive
    # compresses in any case); containerd reads it since 1.5.
    buildah.run("push", "--quiet", "--compression-format", "zstd", p.keyed_name,
                f"oci-archive:{part}:{p.archive_reference}")
    os.replace(part, archive)
    _prune(p, cache)
    image = buildah.image_id(p.keyed_name) or ""
    return BuiltImage(p.target.name, (p.name, p.keyed_name), image, archive, True)


def drop_stale_cache(base: str) -> None:
    """Remove the intermediate images of older builds on ``base``: untagged images that
    no tagged image is built on (an old build's builder stages and source layers, an
    old set of wheels). Those a tagged image is built on stay: they are the layer cache
    that spares the next build installing torch again."""
    listing = buildah.images()
    tagged = [buildah.layers(image) for image, names in listing if names]
    root = buildah.layers(base)[:1]
    for image, names in listing:
        chain = buildah.layers(image) if not names else []
        if chain[:1] == root and not any(t[:len(chain)] == chain for t in tagged):
            try:
                buildah.run("rmi", image)
            except ImageError as err:  # in use by a container: next time
                log.info("kept %s: %s", image, err)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One image build per cache at a time (make images and a test run may overlap)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def default_venv() -> Path:
    """The venv this interpreter runs in: the one whose wheels the images install."""
    if sys.prefix == sys.base_prefix:
        raise ImageError("run this with the project venv's python (make images), or pass "
                         "the venv: the images install the wheels it holds")
    return Path(sys.prefix)


def build(names: list[str], venv: Path | None = None,
          cache: Path | None = None) -> list[BuiltImage]:
    """Build (or find in the cache) the images of the Dockerfile targets ``names``."""
    buildah.require("buildah", "mmdebstrap", RUNTIME)
    venv = venv or default_venv()
    cache = cache or cache_root()
    built: list[BuiltImage] = []
    with _locked(cache / "images"):
        for name in names:
            p = plan(TARGETS[name], venv, cache)
            found = _cached(p, cache)
            built.append(found if found is not None else _build(p, cache))
        if any(image.built for image in built):
            drop_stale_cache(base_image.RECIPE.reference())
    return built


def main(argv: list[str] | None = None) -> int:
    """``python -m ringwright.devcluster.images build [--target T]`` (``make images``)."""
    parser = argparse.ArgumentParser(prog="python -m ringwright.devcluster.images",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    parser.add_argument("--venv", type=Path, help="whose wheels to install "
                        "(default: the venv of this interpreter)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    names = list(TARGETS) if args.target == "all" else [args.target]
    started = time.monotonic()
    try:
        for image in build(names, args.venv):
            size = image.archive.stat().st_size / 2**30
            print(f"{image.target:<17} {image.names[0]}  {image.image_id[:12]}  "
                  f"{'built' if image.built else 'cached'}  {image.archive} ({size:.2f} GiB)")
    except (ImageError, WheelhouseError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
