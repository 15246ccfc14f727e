"""The nodes' shared image store: its key, and how a node's root is seeded from it
(the import itself runs with every real-node module, whose nodes start seeded)."""

from __future__ import annotations

import os
from pathlib import Path

from ringwright.devcluster.node import image_store
from ringwright.devcluster.node.image_store import CONTENT, METADATA, SNAPSHOTS


def test_the_key_names_the_archives_whatever_their_order_and_the_containerd_version(
        ) -> None:
    a, b = Path("/x/training-1.tar"), Path("/y/pause.tar")
    assert image_store.store_key([a, b], "1.6") == image_store.store_key([b, a], "1.6")
    assert image_store.store_key([a, b], "1.6") != image_store.store_key([a], "1.6")
    assert image_store.store_key([a], "1.6") != image_store.store_key([a], "1.7")
    assert image_store.store_key([a], "1.6") != image_store.store_key(
        [Path("/x/training-2.tar")], "1.6")


def _store(root: Path) -> Path:
    for rel, text in [(f"{CONTENT}/blobs/sha256/abc", "layer"),
                      (f"{SNAPSHOTS}/metadata.db", "snapshots db"),
                      (f"{SNAPSHOTS}/snapshots/1/fs/usr/bin/python3", "binary"),
                      (f"{METADATA}/meta.db", "images db"),
                      ("io.containerd.runtime.v2.task/ignored", "not an image")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    os.symlink("python3", root / SNAPSHOTS / "snapshots/1/fs/usr/bin/python")
    return root


def test_a_seeded_root_links_blobs_and_snapshots_and_copies_the_databases(
        tmp_path: Path) -> None:
    store = _store(tmp_path / "store")
    node = tmp_path / "node"
    node.mkdir()
    image_store.seed_root(store, node)

    for rel in (f"{CONTENT}/blobs/sha256/abc", f"{SNAPSHOTS}/snapshots/1/fs/usr/bin/python3"):
        assert (node / rel).stat().st_ino == (store / rel).stat().st_ino, rel
    for rel in (f"{SNAPSHOTS}/metadata.db", f"{METADATA}/meta.db"):
        assert (node / rel).read_text() == (store / rel).read_text()
        assert (node / rel).stat().st_ino != (store / rel).stat().st_ino, rel
        (node / rel).write_text("written by the node")  # in place, as bolt does
        assert (store / rel).read_text() != "written by the node"
    assert os.readlink(node / SNAPSHOTS / "snapshots/1/fs/usr/bin/python") == "python3"
    assert not (node / "io.containerd.runtime.v2.task").exists()


def test_stores_whose_archive_is_gone_or_unused_for_a_week_or_interrupted_are_removed(
        tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    archive.write_text("")
    kept, gone, unused, interrupted = (tmp_path / "cache" / f"store-{n}" for n in "abcd")
    for store, listed in ((kept, archive), (gone, tmp_path / "rebuilt.tar"),
                          (unused, archive)):
        store.mkdir(parents=True)
        (store / image_store.ARCHIVES).write_text(f"{listed}\n")
        (store / image_store.READY).touch()
    interrupted.mkdir()
    now = (kept / image_store.READY).stat().st_mtime + image_store.UNUSED_S - 1
    old = now - image_store.UNUSED_S - 1
    os.utime(unused / image_store.READY, (old, old))
    image_store.prune(tmp_path / "cache", now)
    assert kept.is_dir()
    assert not gone.exists() and not unused.exists() and not interrupted.exists()
