"""The NCCL path without a GPU: environment, backend choice and the abort seam."""

from __future__ import annotations

import pytest
import torch

from ringwright.runtime.collectives.flat import flatten, unflatten_into
from ringwright.runtime.collectives.torch_backend import (
    NCCL_ERROR_ENV,
    TorchDistributedBackend,
    abort_group,
)
from ringwright.runtime.settings import RuntimeSettings


def test_nccl_error_handling_is_set_over_the_images_values() -> None:
    # An image that makes NCCL errors kill the process must not win: the process has
    # to survive a peer's death to roll back.
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "0",
               "UNRELATED": "kept"}
    backend = TorchDistributedBackend(torch.device("cuda", 0), RuntimeSettings(),
                                      environ=environ)
    assert backend.name == "nccl"
    assert environ == {**NCCL_ERROR_ENV, "UNRELATED": "kept"}
    assert environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1", "init must be abortable"


def test_cpu_training_leaves_the_nccl_environment_alone() -> None:
    environ: dict[str, str] = {}
    backend = TorchDistributedBackend(torch.device("cpu"), RuntimeSettings(), environ=environ)
    assert backend.name == "gloo" and environ == {}


class FakeCommunicators:
    """Stands in for an NCCL process group: records aborts, may refuse one."""

    def __init__(self, refuse: bool = False) -> None:
        self.aborts = 0
        self.refuse = refuse

    def abort(self) -> None:
        self.aborts += 1
        if self.refuse:
            raise RuntimeError("NCCL communicator already destroyed")


@pytest.mark.parametrize(("group", "outcome"), [
    (FakeCommunicators(), "communicators aborted"),
    (FakeCommunicators(refuse=True), "abort failed: NCCL communicator already destroyed"),
    (None, "no group formed yet"),
])
def test_abort_group(group: FakeCommunicators | None, outcome: str) -> None:
    assert abort_group(group) == outcome
    if group is not None:
        assert group.aborts == 1


def test_a_gpu_state_with_cpu_tensors_flattens_onto_the_collective_device() -> None:
    # Adam keeps its step counts on the CPU beside CUDA moments, in the same dtype:
    # a state sync on a GPU joins both into one buffer on the GPU ("meta" stands in
    # for it here; joining tensors of two devices raises, as on a GPU).
    on_gpu = torch.ones(3, device="meta")
    step = torch.tensor(5.0)
    flat = flatten([on_gpu, step], torch.device("meta"))
    assert flat.device.type == "meta" and flat.shape == (4,)
    back = [torch.empty(3), torch.tensor(0.0)]
    unflatten_into(torch.arange(4.0), back)
    assert back[0].tolist() == [0.0, 1.0, 2.0] and float(back[1]) == 3.0
