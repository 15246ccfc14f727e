"""Wheels for an image build, taken from a virtual environment that already holds them.

An image installs the very distributions the project's venv has: each one is packed
back into a wheel from its installed files (its RECORD lists them), so building an
image downloads nothing, torch and its CUDA libraries included.

Wheels are packed once into ``<cache>/wheelhouse/pool/`` and a set of them (what one
image installs) is a folder of hard links, ``<cache>/wheelhouse/<digest>/``, named by a
digest of its members: the digest of a distribution is that of its RECORD, which holds
a hash of every file.
"""

from __future__ import annotations

import csv
import email.parser
import hashlib
import io
import os
import re
import shutil
import tempfile
import zipfile
from base64 import urlsafe_b64encode
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import PathDistribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

_CHUNK = 1 << 20
_INSTALLER_FILES = ("INSTALLER", "REQUESTED", "RECORD", "direct_url.json")
"""Written by the installer, not part of the wheel."""
_EPOCH = (1980, 1, 1, 0, 0, 0)
"""Zip entries carry this date, so packing the same files twice gives the same bytes."""


class WheelhouseError(RuntimeError):
    """The venv cannot supply the wheels an image needs."""


@dataclass(frozen=True)
class Installed:
    """One distribution installed in a venv."""

    name: str
    """Canonical name (PEP 503)."""
    version: str
    dist_info: Path
    requires: tuple[str, ...]
    digest: str
    """sha256 of the name, version and the RECORD hashes of the files its wheel held:
    the same distribution installed in two venvs has one digest."""


def site_packages(venv: Path) -> Path:
    """The site-packages folder of ``venv``."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise WheelhouseError(f"{venv} is not a virtual environment (no "
                              "lib/python3.*/site-packages); pass the project's venv")
    return found[0]


def installed(site: Path) -> dict[str, Installed]:
    """Every distribution in ``site``, by canonical name."""
    found: dict[str, Installed] = {}
    for dist_info in sorted(site.glob("*.dist-info")):
        dist = PathDistribution(dist_info)
        if dist.read_text("RECORD") is None:
            continue
        name = canonicalize_name(dist.metadata["Name"])
        digest = hashlib.sha256(f"{name}\0{dist.version}".encode())
        for _, arcname, record_hash in _members(dist_info):
            digest.update(f"\0{arcname}\0{record_hash}".encode())
        found[name] = Installed(name, dist.version, dist_info, tuple(dist.requires or ()),
                                digest.hexdigest())
    return found


def _wanted(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in ("", *extras))


def closure(roots: Iterable[str], dists: Mapping[str, Installed], venv: Path,
            leave_out: Iterable[str] = ()) -> list[Installed]:
    """The distributions of ``dists`` that installing ``roots`` (requirement strings,
    markers and all) brings in, dependencies of dependencies included, sorted by name.

    Names in ``leave_out`` are neither taken nor followed. Raises
    :class:`WheelhouseError` when the venv lacks one or has a version the requirement
    refuses.
    """
    skip = {canonicalize_name(n) for n in leave_out}
    taken: dict[str, Installed] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, "the image") for r in map(Requirement, roots) if _wanted(r, ())]
    while todo:
        req, wanted_by = todo.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if name in skip or key in seen:
            continue
        seen.add(key)
        dist = dists.get(name)
        if dist is None:
            raise WheelhouseError(f"{wanted_by} needs {req} but {venv} does not have "
                                  f"{req.name}; install it there (make env)")
        if not req.specifier.contains(dist.version, prereleases=True):
            raise WheelhouseError(f"{wanted_by} needs {req} but {venv} has {req.name} "
                                  f"{dist.version}; update the venv (make env)")
        taken[name] = dist
        todo.extend((r, f"{name} {dist.version}") for r in map(Requirement, dist.requires)
                    if _wanted(r, req.extras))
    return [taken[n] for n in sorted(taken)]


def set_digest(dists: Iterable[Installed], files: Iterable[Path] = ()) -> str:
    """The digest a set of wheels is known by: its distributions' digests and the
    contents of any ready-made wheel ``files``."""
    digest = hashlib.sha256()
    for dist in sorted(dists, key=lambda d: d.name):
        digest.update(dist.digest.encode() + b"\n")
    for path in sorted(files, key=lambda p: p.name):
        with path.open("rb") as f:
            digest.update(path.name.encode() + hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def wheel_name(dist: Installed) -> str:
    """The file name of ``dist``'s wheel (its tags as its WHEEL file lists them)."""
    meta = email.parser.Parser().parsestr((dist.dist_info / "WHEEL").read_text())
    tags = [t.split("-") for t in meta.get_all("Tag") or []]
    if not tags:
        raise WheelhouseError(f"{dist.dist_info}/WHEEL names no tags")
    parts = [re.sub(r"[-_.]+", "_", dist.name), str(Version(dist.version))]
    if meta.get("Build"):
        parts.append(str(meta["Build"]))
    parts.extend(".".join(sorted({t[i] for t in tags})) for i in range(3))
    return "-".join(parts) + ".whl"


def _data_folder(dist_info: Path) -> str:
    return dist_info.name.removesuffix(".dist-info") + ".data"


def _entry_points(dist_info: Path) -> set[str]:
    """Names of the scripts the installer wrote from entry points."""
    return {ep.name for ep in PathDistribution(dist_info).entry_points
            if ep.group in ("console_scripts", "gui_scripts")}


def _members(dist_info: Path) -> list[tuple[Path, str, str]]:
    """(installed file, name in the wheel, hash in RECORD) for every file the wheel
    held: not what the installer made (bytecode, entry-point scripts, its records)."""
    site = dist_info.parent
    prefix = site.parents[2]
    data = _data_folder(dist_info)
    scripts = _entry_points(dist_info)
    members: list[tuple[Path, str, str]] = []
    for row in csv.reader(io.StringIO((dist_info / "RECORD").read_text())):
        rel, record_hash = row[0], row[1] if len(row) > 1 else ""
        path = Path(os.path.normpath(site / rel))
        if path.parent == dist_info and path.name in _INSTALLER_FILES:
            continue
        if path.suffix == ".pyc" and path.parent.name == "__pycache__":
            continue
        if path.is_relative_to(site):
            members.append((path, path.relative_to(site).as_posix(), record_hash))
            continue
        outside = path.relative_to(prefix).as_posix()
        if outside.startswith("bin/"):
            if path.name not in scripts:
                members.append((path, f"{data}/scripts/{path.name}", record_hash))
        else:
            members.append((path, f"{data}/data/{outside}", record_hash))
    return members


def _script_bytes(path: Path) -> bytes:
    # The installer pointed the script's "#!python" at the venv's interpreter: undo it.
    text = path.read_bytes()
    first, sep, rest = text.partition(b"\n")
    if first.startswith(b"#!") and b"python" in first:
        return b"#!python" + sep + rest
    return text


def repack(dist: Installed, dest: Path) -> Path:
    """Write ``dist`` back into a wheel under folder ``dest``; returns its path.

    Uncompressed: the wheel only travels to a local build, and pip unpacks stored
    members fastest.
    """
    target = dest / wheel_name(dist)
    record_name = f"{dist.dist_info.name}/RECORD"
    data_scripts = _data_folder(dist.dist_info) + "/scripts/"
    lines: list[str] = []
    with tempfile.NamedTemporaryFile(dir=dest, suffix=".part", delete=False) as tmp, \
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as wheel:
        for path, arcname, _ in _members(dist.dist_info):
            if not path.is_file():
                raise WheelhouseError(f"{path} is listed in {dist.dist_info}/RECORD but "
                                      f"missing; reinstall {dist.name} in the venv")
            info = zipfile.ZipInfo(arcname, _EPOCH)
            info.external_attr = (path.stat().st_mode & 0xFFFF) << 16
            sha = hashlib.sha256()
            size = 0
            script = arcname.startswith(data_scripts)
            chunks = (_script_bytes(path),) if script else _read_chunks(path)
            with wheel.open(info, "w", force_zip64=True) as out:
                for chunk in chunks:
                    sha.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            b64 = urlsafe_b64encode(sha.digest()).rstrip(b"=").decode()
            lines.append(f"{arcname},sha256={b64},{size}")
        lines.append(f"{record_name},,")
        wheel.writestr(zipfile.ZipInfo(record_name, _EPOCH), "\n".join(lines) + "\n")
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, target)
    return target


def _read_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _link(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another filesystem
        shutil.copy2(src, dest)


def ensure_set(root: Path, dists: Iterable[Installed], files: Iterable[Path] = ()) -> Path:
    """The folder ``root/<digest>`` holding a wheel of every one of ``dists`` and the
    ready-made wheel ``files``; packs the wheels the pool lacks."""
    dists, files = list(dists), list(files)
    folder = root / set_digest(dists, files)[:16]
    if folder.is_dir():
        return folder
    pool = root / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".set-"))
    try:
        for dist in dists:
            entry = pool / dist.digest[:16]
            wheels = sorted(entry.glob("*.whl")) if entry.is_dir() else []
            if not wheels:
                entry.mkdir(exist_ok=True)
                wheels = [repack(dist, entry)]
            _link(wheels[0], staging / wheels[0].name)
        for path in files:
            _link(path, staging / path.name)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
