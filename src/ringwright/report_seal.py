"""Reports that say who wrote them: one side of the contract for both the runtime and
the operator (imports neither kopf nor torch).

Every pod may merge-patch the job's reports ConfigMap, so the key a report sits under
(``<pod>``) proves nothing: a member could write reports under its peers' names and
make up the quorum that evicts a healthy pod. So each pod gets its own report key,
chosen at random by the operator when it creates the pod and given to that pod only
(``RINGWRIGHT_REPORT_KEY``; the job's pods cannot read pods, or each other's
environment). A report carries an HMAC over the reporting pod's name and the report;
the operator counts a report only when the MAC is valid for the pod whose key it sits
under, so a member can speak for itself and for no one else.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from .world import MemberStats, Report


def _sealed_body(report: Report) -> str:
    """``report`` as its MAC covers it: as one version older writes it (the generation
    under the deprecated ``epoch`` only), so a seal verifies across that version gap."""
    doc = json.loads(report.model_copy(update={"mac": ""}).to_json())
    del doc["generation"]
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _mac(pod: str, report: Report, key: str) -> str:
    message = pod.encode() + b"\0" + _sealed_body(report).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def seal(pod: str, report: Report, key: str) -> Report:
    """``report`` of ``pod`` with its MAC under ``key`` (unchanged when ``key`` is empty)."""
    if not key:
        return report
    return report.model_copy(update={"mac": _mac(pod, report, key)})


def written_by(pod: str, report: Report, key: str) -> bool:
    """Whether ``report``, found under ``pod``'s name, was sealed with ``pod``'s ``key``."""
    return bool(report.mac) and hmac.compare_digest(report.mac, _mac(pod, report, key))


def _stats_mac(pod: str, stats: MemberStats, key: str) -> str:
    # A domain of its own: a report's MAC never verifies as stats, nor the other way round.
    body = stats.model_copy(update={"mac": ""}).to_json()
    message = pod.encode() + b"\0stats\0" + body.encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def seal_stats(pod: str, stats: MemberStats, key: str) -> MemberStats:
    """``stats`` of ``pod`` with its MAC under ``key`` (unchanged when ``key`` is empty)."""
    if not key:
        return stats
    return stats.model_copy(update={"mac": _stats_mac(pod, stats, key)})


def stats_written_by(pod: str, stats: MemberStats, key: str) -> bool:
    """Whether ``stats``, found under ``pod``'s name, were sealed with ``pod``'s ``key``."""
    return bool(stats.mac) and hmac.compare_digest(stats.mac, _stats_mac(pod, stats, key))
