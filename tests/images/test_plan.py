"""What an image build is made of and the names its result goes by (no buildah)."""

from __future__ import annotations

from pathlib import Path

from ringwright.devcluster.images import TARGETS, Plan, bud_args, pyproject, roots


def _plan(target: str) -> Plan:
    return Plan(TARGETS[target], "0.1.0", (), None, (), "ab" * 32)


def test_only_the_training_images_install_torch() -> None:
    assert not [r for r in roots(TARGETS["operator"], pyproject()) if r.startswith("torch")]
    for name in ("training", "training-horovod"):
        found = roots(TARGETS[name], pyproject())
        assert [r for r in found if r.startswith("torch")]
        assert "wheel" in found  # what building the project's wheel needs, offline


def test_names_tags_and_the_archive() -> None:
    plan = _plan("training-horovod")
    assert plan.name == "localhost/ringwright/training:0.1.0-horovod"
    assert plan.keyed_name == "localhost/ringwright/training:0.1.0-horovod-abababababab"
    assert plan.archive_reference == "docker.io/ringwright/training:0.1.0-horovod"
    assert plan.archive(Path("/c")) == Path("/c/images/training-horovod-abababababab.tar")


def test_builds_run_offline_on_runc_from_the_wheelhouse() -> None:
    args = bud_args(_plan("training"), "base:1", "set1", "", Path("/wh"))
    assert args[args.index("--network") + 1] == "none"
    assert args[args.index("--runtime") + 1] == "runc"
    assert {"PYTHON_IMAGE=base:1", "WHEELHOUSE=set1"} <= set(args)
    assert "wheelhouse=/wh" in args and not [a for a in args if "HOROVOD" in a]
    args = bud_args(_plan("training-horovod"), "base:1", "set1", "set2/h.whl", Path("/wh"))
    assert "HOROVOD_WHEEL=set2/h.whl" in args
