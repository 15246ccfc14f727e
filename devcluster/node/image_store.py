"""A containerd image store made once and handed to every real node by hard links.

Importing the 2.7 GB training image into a node's containerd copies the archive into
the content store and unpacks every layer: about 110 s per node on a loaded two-core
machine, paid again by every node of every test module. Instead, the archives a set of
nodes needs are imported once into a throwaway containerd whose root is kept in the
cache (keyed by the archives' names, which carry their digests, and containerd's
version), and each node's root starts as hard links to that store: seconds.

Hard links are safe here because containerd never writes into a blob or a committed
snapshot: a container's changes go to its own new snapshot folder, and a deleted
image only unlinks the node's names. Only the two bolt databases are written in place,
so those are copied.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from . import host, image

CONTENT = "io.containerd.content.v1.content"
SNAPSHOTS = "io.containerd.snapshotter.v1.overlayfs"
METADATA = "io.containerd.metadata.v1.bolt"
SEEDED = (CONTENT, SNAPSHOTS, METADATA)
"""The folders of a containerd root that hold its images (and nothing else)."""

DATABASE_SUFFIX = ".db"
"""bolt databases: written in place, so each node gets its own copy."""

ARCHIVES = "archives"
"""The archives a store holds, one path a line: it goes when one of them does."""

READY = "ready"
"""Written last into a finished store (a store without it is an interrupted one), and
touched on every use."""

UNUSED_S = 7 * 24 * 3600.0
"""A store nobody used for this long goes (a test module that changed its images)."""


def store_key(archives: Sequence[Path], containerd_version: str) -> str:
    """The name of the store holding ``archives`` (their file names carry their
    content digests) as imported by that containerd version."""
    text = "\n".join([containerd_version, *sorted(a.name for a in archives)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def template_config(root: Path) -> str:
    """The throwaway containerd's config: its root, state and socket under ``root``,
    with the CRI plugin off (no kubelet talks to it)."""
    return "\n".join([
        "version = 2",
        f'root = "{root / "root"}"',
        f'state = "{root / "state"}"',
        'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]',
        "[grpc]",
        f'  address = "{root / "containerd.sock"}"',
        "[ttrpc]",
        f'  address = "{root / "containerd.sock.ttrpc"}"',
    ]) + "\n"


def ensure_store(archives: Sequence[Path], cache: Path, *, containerd: Path,
                 ctr: Path) -> Path:
    """The containerd root holding ``archives``' images, imported under ``cache`` the
    first time it is asked for. Stores of archives that are gone (an image rebuilt
    under a new digest) are removed."""
    version = subprocess.run([str(containerd), "--version"], capture_output=True,
                             text=True, check=True).stdout.strip()
    final = cache / f"store-{store_key(archives, version)}"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prune(cache, time.time())
        if not (final / READY).is_file():
            _import_store(archives, final, containerd=containerd, ctr=ctr)
        (final / READY).touch()  # its mtime says when it was last used
    return final / "root"


def prune(cache: Path, now: float) -> None:
    """Remove the stores in ``cache`` that hold an archive no longer there (an image
    rebuilt under a new digest), those unused for :data:`UNUSED_S`, and those an
    interrupted import left (call it holding the cache's lock: stores are built under
    it)."""
    for store in [*cache.glob("store-*"), *cache.glob("building-*")]:
        ready = store / READY
        if not all(Path(a).is_file() for a in _archives_of(store)) \
                or not ready.is_file() or now - ready.stat().st_mtime > UNUSED_S:
            shutil.rmtree(store, ignore_errors=True)


def _import_store(archives: Sequence[Path], final: Path, *, containerd: Path,
                  ctr: Path) -> None:
    work = final.with_name(f"building-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = work / "config.toml"
    config.write_text(template_config(work))
    log = work / "containerd.log"
    daemon = host.spawn("containerd", "image store", [str(containerd), "--config", str(config)],
                        log)
    try:
        host.wait_for_socket(work / "containerd.sock", daemon, log, timeout=60)
        for archive in archives:
            image.import_image(ctr, work / "containerd.sock", archive)
    finally:
        host.stop([daemon], grace=30.0)
    shutil.rmtree(work / "state", ignore_errors=True)
    (work / ARCHIVES).write_text("".join(f"{a}\n" for a in archives))
    shutil.rmtree(final, ignore_errors=True)  # an interrupted one, without READY
    work.rename(final)
    (final / READY).touch()


def _archives_of(store: Path) -> list[str]:
    """The archives a store was imported from (none known: an interrupted store)."""
    listing = store / ARCHIVES
    return listing.read_text().split() if listing.is_file() else ["/nonexistent"]


def seed_root(store: Path, containerd_root: Path) -> None:
    """Lay ``store``'s images into an empty node root: hard links, databases copied."""
    def link_or_copy(src: str, dst: str) -> None:
        if not src.endswith(DATABASE_SUFFIX):
            try:
                os.link(src, dst)
                return
            except OSError as err:
                if err.errno != errno.EXDEV:  # another filesystem: copy instead
                    raise
        shutil.copy2(src, dst)

    for folder in SEEDED:
        if (store / folder).is_dir():
            shutil.copytree(store / folder, containerd_root / folder, symlinks=True,
                            copy_function=link_or_copy)
