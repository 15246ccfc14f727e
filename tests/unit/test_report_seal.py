"""Sealed reports: a member speaks for itself and for no one else."""

from __future__ import annotations

from ringwright.eviction import judge
from ringwright.objects import Obj
from ringwright.operator.plan.isolation import honest_reports, report_key, with_report_key
from ringwright.report_seal import seal, written_by
from ringwright.world import Env, JobRef, Member, Report, ReportKind, StoreAddress, World

KEYS = {"w-0": "key-0", "w-1": "key-1", "w-2": "key-2", "w-3": "key-3"}


def pod(name: str, key: str | None) -> Obj:
    body: Obj = {"metadata": {"name": name}, "spec": {"containers": [{"name": "train"}]}}
    return with_report_key(body, key) if key is not None else body


def world() -> World:
    members = tuple(Member(rank=i, pod=f"w-{i}", ip=f"127.0.0.{i + 1}") for i in range(4))
    return World(job=JobRef(namespace="ns", name="j"), generation=5, members=members,
                 store=StoreAddress(address="127.0.0.1"))


def suspect(victim: str) -> Report:
    return Report(kind=ReportKind.PEER_DEAD, generation=5, at=1.0, suspects=(victim,))


def test_a_report_is_valid_only_for_the_pod_and_key_that_sealed_it() -> None:
    sealed = seal("w-0", suspect("w-3"), "key-0")
    assert written_by("w-0", sealed, "key-0")
    assert not written_by("w-1", sealed, "key-0")  # moved under another name
    assert not written_by("w-0", sealed, "key-1")
    assert not written_by("w-0", suspect("w-3"), "key-0")  # not sealed
    altered = sealed.model_copy(update={"suspects": ("w-2",)})
    assert not written_by("w-0", altered, "key-0")


def test_one_member_forging_its_peers_reports_evicts_nobody() -> None:
    pods = [pod(name, key) for name, key in KEYS.items()]
    # w-0 knows only its own key: it writes its own report and two under its
    # peers' names, all naming the healthy w-3.
    written = {"w-0": seal("w-0", suspect("w-3"), "key-0"),
               "w-1": seal("w-1", suspect("w-3"), "key-0"),
               "w-2": suspect("w-3")}
    assert [e.pod for e in judge(world(), written)] == ["w-3"]  # what the forgery aimed at
    counted = honest_reports(written, pods)
    assert list(counted) == ["w-0"]
    assert judge(world(), counted) == []
    # A second member's honest report corroborates it.
    written["w-1"] = seal("w-1", suspect("w-3"), "key-1")
    assert [e.pod for e in judge(world(), honest_reports(written, pods))] == ["w-3"]


def test_pods_without_a_key_are_taken_at_their_word() -> None:
    assert report_key(pod("old", None)) is None
    assert report_key(pod("new", "k")) == "k"
    assert honest_reports({"old": suspect("x")}, [pod("old", None)]) == {"old": suspect("x")}


def test_the_key_is_one_env_var_of_the_training_container() -> None:
    body = with_report_key(with_report_key(pod("p", None), "a"), "b")
    env = body["spec"]["containers"][0]["env"]
    assert env == [{"name": Env.REPORT_KEY, "value": "b"}]
