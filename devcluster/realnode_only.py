"""Real nodes made plain, schedulable nodes and the KWOK nodes set aside, as
``kubectl taint`` and ``kubectl cordon`` would: a job that names no node and tolerates
no taint then lands on the real nodes through the operator's own placement."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ringwright.kube import KubeClient, api_path
from ringwright.objects import Obj

from .inventory import KWOK_NODE_ANNOTATION
from .node.layout import REAL_NODE_LABEL

REAL_NODE_TAINT: Obj = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
"""The taint every real node starts with (:mod:`.realnode`)."""


def kwok_nodes(kube: KubeClient) -> list[str]:
    """The names of the inventory's (KWOK's) nodes."""
    return sorted(n["metadata"]["name"] for n in kube.list(api_path("v1", "nodes"))
                  if KWOK_NODE_ANNOTATION in (n["metadata"].get("annotations") or {}))


def taints(current: Sequence[Obj], real: bool) -> list[Obj]:
    """``current`` with the real-node taint (``real``) or without it."""
    rest = [t for t in current if t.get("key") != REAL_NODE_LABEL]
    return [*rest, REAL_NODE_TAINT] if real else rest


def _set_taint(kube: KubeClient, node: str, real: bool) -> None:
    path = api_path("v1", "nodes", name=node)
    current = kube.get(path)["spec"].get("taints") or []
    kube.merge_patch(path, {"spec": {"taints": taints(current, real)}})


def _cordon(kube: KubeClient, nodes: Sequence[str], cordoned: bool) -> None:
    for node in nodes:
        kube.merge_patch(api_path("v1", "nodes", name=node),
                         {"spec": {"unschedulable": cordoned or None}})


@contextmanager
def real_nodes_only(kube: KubeClient, real: Sequence[str]) -> Iterator[list[str]]:
    """Inside: the KWOK nodes cordoned and the real nodes ``real`` without their taint;
    yields the KWOK nodes' names. Both are put back on the way out."""
    kwok = kwok_nodes(kube)
    _cordon(kube, kwok, True)
    try:
        for node in real:
            _set_taint(kube, node, False)
        yield kwok
    finally:
        for node in real:
            _set_taint(kube, node, True)
        _cordon(kube, kwok, False)
