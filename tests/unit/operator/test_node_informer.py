"""The operator's own node informer: a list, then a watch from its version; an expired
version lists again; every change reaches the ledger, and a round never sees a node
half-written."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

from ringwright.kube import ApiError, KubeClient
from ringwright.objects import Obj
from ringwright.operator.observe.nodes import NodeInformer


def node(name: str, version: str, gpus: str = "8", ready: bool = True) -> Obj:
    return {"metadata": {"name": name, "resourceVersion": version, "labels": {"rack": "r0"}},
            "status": {"allocatable": {"nvidia.com/gpu": gpus},
                       "conditions": [{"type": "Ready",
                                       "status": "True" if ready else "False"}]}}


class FakeKube:
    """Answers lists from ``lists`` and watches from ``watches``, in order; records the
    version each watch started from. Stops the informer when both run out."""

    def __init__(self, lists: list[tuple[list[Obj], str]], watches: list[list[Obj]],
                 informer: list[NodeInformer]) -> None:
        self.lists, self.watches, self.informer = lists, watches, informer
        self.watched_from: list[str] = []

    def list_with_version(self, path: str) -> tuple[list[Obj], str]:
        assert path == "/api/v1/nodes"
        if not self.lists:
            self.informer[0].stop()
            raise ApiError(0, "", "no more lists", "LIST")
        return self.lists.pop(0)

    def watch(self, path: str, *, resource_version: str, timeout_seconds: int
              ) -> Iterator[Obj]:
        self.watched_from.append(resource_version)
        if not self.watches:
            self.informer[0].stop()
            return iter(())
        return iter(self.watches.pop(0))


def run(lists: list[tuple[list[Obj], str]], watches: list[list[Obj]]
        ) -> tuple[NodeInformer, FakeKube, list[set[str]]]:
    marked: list[set[str]] = []
    holder: list[NodeInformer] = []
    kube = FakeKube(lists, watches, holder)
    informer = NodeInformer(cast(KubeClient, kube), marked.append)
    holder.append(informer)
    informer.run()
    return informer, kube, marked


def test_a_list_then_watch_events_keep_every_node_and_tell_the_ledger() -> None:
    informer, kube, marked = run(
        [([node("a", "1"), node("b", "2")], "10")],
        [[{"type": "MODIFIED", "object": node("a", "11", gpus="4")},
          {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
          {"type": "ADDED", "object": node("c", "16", ready=False)},
          {"type": "DELETED", "object": node("b", "17")}]])
    assert informer.synced.is_set()
    assert sorted(informer.records) == ["a", "c"]
    (a,) = informer.records["a"]
    assert a["allocatable"] == {"nvidia.com/gpu": "4"}
    (c,) = informer.records["c"]
    assert c["schedulable"] is False
    assert marked == [{"a", "b"}, {"a"}, {"c"}, {"b"}]
    # Each watch goes on from the last version seen, bookmarks included.
    assert kube.watched_from == ["10", "17"]


def test_an_expired_version_lists_again_and_drops_nodes_gone_meanwhile() -> None:
    expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                            "reason": "Expired", "message": "too old"}}
    informer, kube, marked = run(
        [([node("a", "1"), node("b", "2")], "10"), ([node("b", "30")], "31")],
        [[expired]])
    assert sorted(informer.records) == ["b"]
    assert marked[-1] == {"a", "b"}  # a went while the watch was down: marked too
    assert kube.watched_from == ["10", "31"]


def test_rounds_read_whole_records_while_the_watch_writes() -> None:
    events = [{"type": "MODIFIED", "object": node(f"n{i % 50}", str(100 + i),
                                                  gpus=str(i % 9))} for i in range(5000)]
    seen_bad: list[Any] = []
    done = threading.Event()
    informer_box: list[NodeInformer] = []

    def read() -> None:
        while not done.is_set() and informer_box:
            records = informer_box[0].records
            for name in set(records):  # what the ledger does with a kopf index
                got = records.get(name, ())
                if len(tuple(got)) != 1:
                    seen_bad.append(got)

    reader = threading.Thread(target=read)
    marked: list[set[str]] = []
    holder: list[NodeInformer] = []
    kube = FakeKube([([node(f"n{i}", "1") for i in range(50)], "99")], [events], holder)
    informer = NodeInformer(cast(KubeClient, kube), marked.append)
    holder.append(informer)
    informer_box.append(informer)
    reader.start()
    informer.run()
    done.set()
    reader.join()
    assert seen_bad == [] and len(informer.records) == 50


def test_a_failure_inside_the_informer_lists_again_instead_of_leaving_nodes_stale() -> None:
    informer, _, _ = run([([{"kind": "Node"}], "1"),  # no metadata: a bug's KeyError
                          ([node("a", "2")], "3")], [])
    assert sorted(informer.records) == ["a"] and informer.synced.is_set()
