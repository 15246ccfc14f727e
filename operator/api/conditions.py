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


def condition(conditions: list[Obj], type_: str) -> Obj | None:
    """The condition of ``type_`` in a status read as JSON, if present."""
    return next((c for c in conditions if c.get("type") == type_), None)
