"""Conditions and timestamps in the shape Kubernetes users know (metav1.Condition)."""

from __future__ import annotations

from datetime import UTC, datetime

from ringwright.objects import Obj


def rfc3339(ts: float) -> str:
    """Seconds since the Unix epoch as an RFC 3339 UTC timestamp."""
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    """An RFC 3339 timestamp as seconds since the Unix epoch (None stays None)."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def set_condition(
    conditions: list[Obj],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: float,
    generation: int,
) -> list[Obj]:
    """Return ``conditions`` with ``type_`` set; lastTransitionTime moves only on a flip."""
    value = "True" if status else "False"
    out: list[Obj] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(cond)
            continue
        found = True
        changed = cond.get("status") != value
        out.append({
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": rfc3339(now) if changed else cond.get("lastTransitionTime"),
            "observedGeneration": generation,
        })
    if not found:
        out.append({
            "type": type_, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": rfc3339(now), "observedGeneration": generation,
        })
    return out


def condition(conditions: list[Obj], type_: str) -> Obj | None:
    """The condition of ``type_``, if present."""
    return next((c for c in conditions if c.get("type") == type_), None)
