"""Real nodes (a kubelet and containerd each) in the run's one local cluster.

They need root and host packages; the check says which. With ``CI=true`` a machine
without them fails the tests, elsewhere they skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ringwright.devcluster import images
from ringwright.devcluster.buildah import ImageError
from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.realnode import (
    RealNodeSet,
    RealNodeSpec,
    missing_requirements,
    requirements_message,
    start_real_nodes,
)
from tests.conftest import IN_CI

SPECS = (RealNodeSpec("real-rack-r0-node-0", rack="rack-r0", nvlink_domain="rack-r0-nvl-3",
                      gpu_model="NVIDIA-A100-SXM4-40GB", gpus=4),
         RealNodeSpec("real-rack-r0-node-1", rack="rack-r0", nvlink_domain="rack-r0-nvl-3",
                      gpu_model="NVIDIA-A100-SXM4-40GB", gpus=4))
"""The module's real nodes: labels and GPUs unlike the spec's defaults, so a test sees
that they come from the spec; two, so pods on one reach pods on the other."""


@pytest.fixture(scope="session")
def can_run_real_nodes() -> None:
    """This machine can run real nodes: a skip locally when not, a failure in CI."""
    missing = missing_requirements()
    if missing:
        if IN_CI:
            pytest.fail(requirements_message(missing))
        pytest.skip(requirements_message(missing))


@pytest.fixture(scope="module")
def real_nodes(cluster: Cluster, can_run_real_nodes: None,
               request: pytest.FixtureRequest) -> Iterator[RealNodeSet]:
    """:data:`SPECS` as real nodes of the cluster for one test module, removed after it
    (Node objects too), so the cluster's other tests never see them. They start with
    the images of the targets the module names in ``NODE_IMAGES`` (seeded from a store
    imported once, where loading them later would import them into every node)."""
    images = [_built(target) for target in getattr(request.module, "NODE_IMAGES", ())]
    with cluster.client() as kube:
        nodes = start_real_nodes(kube, cluster.dir, cluster.kubeconfig, SPECS, images=images)
        try:
            yield nodes
        finally:
            nodes.stop(kube)


@pytest.fixture(scope="module")
def operator_image(real_nodes: RealNodeSet) -> str:
    """The ``operator`` image (built here, or found in the cache), loaded into the real
    nodes' containerd; its name as a pod spec gives it."""
    real_nodes.load_image(_built("operator"))
    return image_name("operator")


@pytest.fixture(scope="module")
def training_image(real_nodes: RealNodeSet) -> str:
    """The ``training`` image, loaded into the real nodes' containerd; its name."""
    real_nodes.load_image(_built("training"))
    return image_name("training")


@pytest.fixture(scope="module")
def horovod_image(real_nodes: RealNodeSet) -> str:
    """The ``training-horovod`` image (Horovod built from source inside), loaded into the
    real nodes' containerd; its name."""
    real_nodes.load_image(_built("training-horovod"))
    return image_name("training-horovod")


def _built(target: str) -> Path:
    """The OCI archive of ``target`` (built here, or found in the cache); a skip where
    images cannot be built (a failure in CI)."""
    try:
        return images.build([target])[0].archive
    except ImageError as err:
        message = f"cannot build the {target} image: {err}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def image_name(target: str) -> str:
    """How a pod spec names the image of Dockerfile target ``target`` (the name its
    archive gives it, as the chart and the examples write it)."""
    t = images.TARGETS[target]
    return f"{t.repository}:{images.pyproject()['project']['version']}{t.tag_suffix}"
