"""What keeps one job's pods apart from everything else: its join token and its
NetworkPolicy.

Pure builders of whole objects, like :mod:`ringwright.operator.plan.manifests`:

- the join-token Secret (owned by the job): the runtime tags every value in its generation
  stores with the token, so a process without it cannot claim a rank. It is mounted
  into the training container of the job's pods only. The operator creates it once
  with a random token and never reads it back (its RBAC holds ``create`` on Secrets,
  nothing else);
- the pod: the token's mount, a default securityContext on every container that sets
  none (:mod:`ringwright.operator.api.templates_policy`);
- each pod's report key (:mod:`ringwright.report_seal`): given to that pod alone at
  creation, so a report counts only for the pod that wrote it;
- the NetworkPolicy: the job's pods admit the job's own pods on every port (the
  rendezvous store and the library's collective connections, whose ports are chosen
  at run time), the operator's pods on the readiness and metrics ports, and anyone on
  the metrics port (Prometheus runs wherever the admin put it). Nothing else.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from ringwright.objects import Obj
from ringwright.report_seal import stats_written_by, written_by
from ringwright.world import DEFAULT_METRICS_PORT, Env, MemberStats, Report

from ..api.templates_policy import secure
from .manifests import (
    JOB_LABEL,
    PS,
    READINESS_PORT,
    ROLE_LABEL,
    owner_reference,
)

log = logging.getLogger("ringwright.operator.plan.isolation")

JOIN_TOKEN_KEY = "token"
JOIN_TOKEN_DIR = "/var/run/ringwright/join"
"""Where the training container finds the token (``<dir>/token``)."""
JOIN_TOKEN_VOLUME = "ringwright-join-token"
OPERATOR_POD_LABELS = {"app.kubernetes.io/component": "operator"}
"""Labels of the operator's pods (the chart sets them), admitted for health and metrics."""


def _meta(job: Obj, name: str) -> Obj:
    return {
        "name": name,
        "namespace": job["metadata"]["namespace"],
        "labels": {JOB_LABEL: job["metadata"]["name"]},
        "ownerReferences": [owner_reference(job)],
    }


def join_token_secret_name(job: str) -> str:
    """The Secret holding the job's join token."""
    return f"{job}-join-token"


def new_token() -> str:
    """A fresh random join token (256 bits)."""
    return secrets.token_urlsafe(32)


def join_token_secret(job: Obj, token: str) -> Obj:
    """The job's join-token Secret, owned by the job (deleted with it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, join_token_secret_name(job["metadata"]["name"])),
        "type": "Opaque",
        "stringData": {JOIN_TOKEN_KEY: token},
    }


def harden(job: Obj, pod: Obj) -> Obj:
    """``pod`` (built from the job's template, which passed the policy's template
    limits) with what isolates it: the join token, default securityContexts, and the
    ServiceAccount the template names (allowed by the policy) instead of the job's own.
    """
    spec = pod["spec"]
    mount_join_token(job, spec)
    secure(spec)
    role_key = "ps" if pod["metadata"]["labels"].get(ROLE_LABEL) == PS else "workers"
    template = job["spec"][role_key]["template"]["spec"]
    account = template.get("serviceAccountName") or template.get("serviceAccount")
    if account:
        spec["serviceAccountName"] = account
    return pod


def mount_join_token(job: Obj, spec: Obj) -> None:
    """Mount the job's token into the training container of pod ``spec`` (only there)
    and tell the runtime where it is."""
    volume = {"name": JOIN_TOKEN_VOLUME, "secret": {
        "secretName": join_token_secret_name(job["metadata"]["name"]),
        "items": [{"key": JOIN_TOKEN_KEY, "path": JOIN_TOKEN_KEY}],
        # Readable by the container's user whatever its uid; other containers of the
        # pod do not mount it.
        "defaultMode": 0o444,
    }}
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v.get("name") != JOIN_TOKEN_VOLUME]
    spec["volumes"].append(volume)
    main = spec["containers"][0]
    mounts = [m for m in main.get("volumeMounts") or [] if m.get("name") != JOIN_TOKEN_VOLUME]
    main["volumeMounts"] = [*mounts, {"name": JOIN_TOKEN_VOLUME, "mountPath": JOIN_TOKEN_DIR,
                                      "readOnly": True}]
    env = [e for e in main.get("env") or [] if e.get("name") != Env.JOIN_TOKEN_FILE]
    main["env"] = [*env, {"name": Env.JOIN_TOKEN_FILE,
                          "value": f"{JOIN_TOKEN_DIR}/{JOIN_TOKEN_KEY}"}]


def network_policy(job: Obj, operator_namespace: str) -> Obj:
    """The job's NetworkPolicy (see the module docstring for what it admits).

    ``operator_namespace`` empty (an operator running outside the cluster) leaves out
    the operator's rule: its probes then come from outside any pod.
    """
    name = job["metadata"]["name"]
    own = {"podSelector": {"matchLabels": {JOB_LABEL: name}}}
    ingress: list[Obj] = [{"from": [own]}]
    if operator_namespace:
        ingress.append({
            "from": [{
                "namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": operator_namespace}},
                "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
            }],
            "ports": [{"protocol": "TCP", "port": READINESS_PORT}],
        })
    ingress.append({"ports": [{"protocol": "TCP", "port": DEFAULT_METRICS_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, name),
        "spec": {
            "podSelector": {"matchLabels": {JOB_LABEL: name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def with_report_key(pod: Obj, key: str) -> Obj:
    """``pod`` whose training container holds ``key``, its own key for sealing reports.

    Chosen at random per pod when it is created (so the apply step adds it, not the
    pure plan); the job's pods may not read pods, so no member learns another's key.
    """
    main = pod["spec"]["containers"][0]
    env = [e for e in main.get("env") or [] if e.get("name") != Env.REPORT_KEY]
    main["env"] = [*env, {"name": Env.REPORT_KEY, "value": key}]
    return pod


def report_key(pod: Obj) -> str | None:
    """The report key the operator gave ``pod``; None for a pod created without one."""
    for var in pod["spec"]["containers"][0].get("env") or []:
        if var.get("name") == Env.REPORT_KEY:
            return str(var.get("value", ""))
    return None


def honest_reports(reports: Mapping[str, Report], pods: Sequence[Obj]) -> dict[str, Report]:
    """The reports written by the pod whose name they sit under.

    A report under a pod's name counts only when sealed with that pod's key; a pod
    created without a key (by an operator before report keys) is taken at its word.
    Reports under names of no pod of the job are kept: the planner ignores non-members.
    """
    return _sealed(reports, pods, written_by, "a report")


def honest_stats(stats: Mapping[str, MemberStats], pods: Sequence[Obj]
                 ) -> dict[str, MemberStats]:
    """The stats written by the pod whose name they sit under, as :func:`honest_reports`
    (a member that could pass off slow stats under a peer's name could have it evicted);
    stats under names of no pod of the job are kept, for the goodput of pods now gone."""
    return _sealed(stats, pods, stats_written_by, "stats")


Sealed = TypeVar("Sealed", Report, MemberStats)


def _sealed(items: Mapping[str, Sealed], pods: Sequence[Obj],
            sealed_by: Callable[[str, Sealed, str], bool], what: str) -> dict[str, Sealed]:
    """``items`` without those under a pod's name that the pod's key did not seal."""
    keys = {name: report_key(p) for p in pods if (name := p["metadata"]["name"]) in items}
    out: dict[str, Sealed] = {}
    for name, item in items.items():
        key = keys.get(name)
        if key is not None and not sealed_by(name, item, key):
            log.warning("ignoring %s under %s's name that %s did not write", what, name, name)
            continue
        out[name] = item
    return out
