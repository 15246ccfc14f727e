"""The real nodes' one local image: a static program (``pause.c``) in a one-layer OCI
image, written here and imported into each node's containerd.

No registry is reachable, so even the pod sandbox ("pause") image must be built
locally: the image's ``/pause`` sleeps as a pod's sandbox and, given a command, prints
what a test checks (see pause.c). The archive is built from bytes (no image tool): a
layer tar, its config and manifest, and an ``index.json`` naming the image.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "pause.c"
REPOSITORY = "localhost/ringwright/pause"
ENTRYPOINT = "/pause"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
CONTAINERD_NAME = "io.containerd.image.name"
"""The index annotation containerd's importer takes an image's name from."""


def image_ref() -> str:
    """The image's name; its tag changes with the program's source."""
    return f"{REPOSITORY}:{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"


def go_arch(machine: str | None = None) -> str:
    """The OCI architecture name of this machine (``x86_64`` -> ``amd64``)."""
    machine = machine or platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def compile_pause(cache_dir: Path) -> Path:
    """The static ``pause`` program, compiled once per source into ``cache_dir``."""
    out = cache_dir / image_ref().rsplit(":", 1)[1] / "pause"
    if out.is_file():
        return out
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc is not on PATH; real nodes need it to build their image "
                           "(Debian: apt-get install gcc libc6-dev)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    proc = subprocess.run([gcc, "-static", "-O2", "-o", str(tmp), str(SOURCE)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} statically failed (a static C library "
                           f"is needed; Debian: apt-get install libc6-dev):\n{proc.stderr}")
    tmp.replace(out)
    return out


def _blob(data: bytes) -> tuple[str, bytes]:
    return f"sha256:{hashlib.sha256(data).hexdigest()}", data


def _layer(program: bytes) -> bytes:
    """An uncompressed tar holding ``/pause`` only, byte-for-byte reproducible."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(ENTRYPOINT.lstrip("/"))
        info.size, info.mode, info.mtime = len(program), 0o755, 0
        tar.addfile(info, io.BytesIO(program))
    return buf.getvalue()


def oci_archive(program: bytes, ref: str, arch: str) -> bytes:
    """An OCI image layout, as a tar, of one image ``ref`` whose only file is
    ``program`` at ``/pause`` (its entrypoint)."""
    layer_digest, layer = _blob(_layer(program))
    config: dict[str, Any] = {
        "architecture": arch, "os": "linux",
        "config": {"Entrypoint": [ENTRYPOINT], "Env": [PATH_ENV]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest,
                   "size": len(config_bytes)},
        "layers": [{"mediaType": OCI_LAYER, "digest": layer_digest, "size": len(layer)}],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": manifest_digest,
            "size": len(manifest_bytes),
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {CONTAINERD_NAME: ref,
                            "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]},
        }],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
        **{f"blobs/sha256/{d.split(':')[1]}": b for d, b in (
            (layer_digest, layer), (config_digest, config_bytes),
            (manifest_digest, manifest_bytes))},
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def ensure_archive(cache_dir: Path) -> tuple[str, Path]:
    """The image's name and its OCI archive in ``cache_dir`` (built once per source)."""
    ref = image_ref()
    archive = cache_dir / ref.rsplit(":", 1)[1] / "image.tar"
    if not archive.is_file():
        program = compile_pause(cache_dir).read_bytes()
        tmp = archive.with_suffix(".tmp")
        tmp.write_bytes(oci_archive(program, ref, go_arch()))
        tmp.replace(archive)
    return ref, archive


def import_image(ctr: Path, socket: Path, archive: Path) -> None:
    """Import ``archive`` into the CRI namespace of the containerd at ``socket`` and
    unpack it, so the kubelet finds it without pulling."""
    proc = subprocess.run(
        [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images", "import",
         str(archive)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"importing {archive} into containerd ({socket}) failed:\n"
                           f"{proc.stderr[-2000:]}")
