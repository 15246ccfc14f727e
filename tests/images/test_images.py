"""The container images: built (or found in the cache) with buildah from the venv's
wheels, then run with podman on runc with no network.

A cold build takes minutes (the training image installs torch from the venv's wheels);
with nothing changed the build only finds the images. Locally a machine without
buildah, mmdebstrap or podman skips these tests; with CI=true that fails the run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from importlib.metadata import distribution
from pathlib import Path

import pytest

from ringwright.devcluster import images
from ringwright.devcluster.buildah import INSTALL, RUNTIME
from ringwright.devcluster.images import BuiltImage

pytestmark = [pytest.mark.xdist_group("images"), pytest.mark.timeout(3600)]

PODMAN_RUN = ["podman", "--runtime", RUNTIME, "run", "--rm", "--network", "none",
              # The host's hard limits: runc may not raise them.
              "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def _built(target: str) -> BuiltImage:
    missing = [t for t in ("buildah", "mmdebstrap", "podman", RUNTIME) if not shutil.which(t)]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing; install: {INSTALL}")
    return images.build([target])[0]


@pytest.fixture(scope="module")
def operator_image() -> BuiltImage:
    return _built("operator")


@pytest.fixture(scope="module")
def training_image() -> BuiltImage:
    return _built("training")


@pytest.fixture(scope="module")
def horovod_image() -> BuiltImage:
    return _built("training-horovod")


def run(image: BuiltImage, *args: str, entrypoint: str = "", read_only: bool = False) -> str:
    """Run a container of ``image`` (its keyed name) and return its output."""
    options = [*(["--entrypoint", entrypoint] if entrypoint else []),
               *(["--read-only"] if read_only else [])]
    cmd = [*PODMAN_RUN, *options, image.names[1], *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_operator_image_runs_as_10001_on_a_read_only_root_without_torch(
        operator_image: BuiltImage) -> None:
    assert "usage: ringwright-operator" in run(operator_image, "--help", read_only=True)
    facts = run(operator_image, "-c", "import os, importlib.util as u; "
                "print(os.getuid(), os.getgid(), u.find_spec('torch') is None)",
                entrypoint="python", read_only=True)
    assert facts.split() == ["10001", "10001", "True"]


def test_the_training_image_has_the_venvs_torch_the_runtime_and_the_examples(
        training_image: BuiltImage) -> None:
    out = run(training_image, "python", "-c",
              "import hashlib, os, torch; from ringwright.runtime import ElasticRuntime; "
              "v = open(os.path.join(os.path.dirname(torch.__file__), 'version.py'), 'rb'); "
              "print(os.getuid(), hashlib.sha256(v.read()).hexdigest(), "
              "os.path.isfile('/app/examples/train_elastic.py'))")
    # torch/version.py names the build (version, git commit, CUDA): the venv's own.
    venv_torch = Path(str(distribution("torch").locate_file("torch/version.py")))
    assert out.split() == ["10001", hashlib.sha256(venv_torch.read_bytes()).hexdigest(),
                           "True"]
    # What the demo manifest runs starts (its imports resolve) in the image.
    assert "--epochs" in run(training_image, "python", "/app/examples/train_elastic.py",
                             "--help")


def test_the_horovod_image_is_the_training_image_plus_horovod(
        training_image: BuiltImage, horovod_image: BuiltImage) -> None:
    out = run(horovod_image, "python", "-c",
              "import torch, horovod.torch as hvd; hvd.init(); "
              "t = hvd.allreduce(torch.ones(3), op=hvd.Sum); "
              "print(hvd.gloo_enabled(), hvd.size(), t.tolist()); hvd.shutdown()")
    assert out.split()[-5:] == ["True", "1", "[1.0,", "1.0,", "1.0]"]

    def layers(image: BuiltImage) -> list[str]:
        out = subprocess.run(["buildah", "inspect", "--type", "image", image.names[1]],
                             capture_output=True, text=True, check=True).stdout
        return list(json.loads(out)["OCIv1"]["rootfs"]["diff_ids"])

    # Shared layers: the torch layer is stored (and pulled) once for both images.
    assert layers(horovod_image)[:len(layers(training_image))] == layers(training_image)


def test_a_second_build_with_nothing_changed_builds_nothing(
        operator_image: BuiltImage, training_image: BuiltImage,
        horovod_image: BuiltImage) -> None:
    again = images.build(["operator", "training", "training-horovod"])
    assert [i.built for i in again] == [False, False, False]
    assert [i.image_id for i in again] == [operator_image.image_id, training_image.image_id,
                                           horovod_image.image_id]
    for image in again:
        assert image.archive.is_file()
        assert image.archive.name.startswith(image.target + "-")
