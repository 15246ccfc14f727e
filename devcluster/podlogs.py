"""Pod log lines read through the API (``kubectl logs --timestamps``), as the demo on
real nodes reads them: no file of a pod's is on this machine's disk for it to read."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from ringwright.kube import ApiError, KubeClient, api_path

from .timeline import LogLine, merge

_KUBELET_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z (.*)$")
"""The kubelet's RFC 3339 stamp, nanoseconds and all, in front of each line."""
_OWN_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
"""The process's own stamp (``logging``'s asctime), in the container's time zone."""


def parse_api_log(text: str, source: str) -> list[LogLine]:
    """The lines of a ``?timestamps=true`` log, timed by the kubelet's stamp (UTC, so
    the container's time zone does not matter); the process's own stamp is dropped.
    Lines without a stamp of the process (tracebacks, output of other tools) are left
    out, as :func:`.timeline.read_log` leaves them out."""
    lines = []
    for raw in text.splitlines():
        found = _KUBELET_STAMP.match(raw)
        if found is None:
            continue
        rest = found.group(3)
        own = _OWN_STAMP.match(rest)
        if own is None:
            continue
        micros = (found.group(2) or "0")[:6].ljust(6, "0")
        at = datetime.fromisoformat(f"{found.group(1)}.{micros}+00:00").timestamp()
        lines.append(LogLine(at, source, rest[own.end():]))
    return lines


@dataclass
class ApiLogs:
    """The log lines of the pods in ``namespace`` matching ``selector``, read through the
    API. A pod's lines stay after the pod is gone (a deleted worker's last words)."""

    kube: KubeClient
    namespace: str
    selector: str = ""
    seen: dict[str, list[LogLine]] = field(default_factory=dict)

    def pods(self) -> dict[str, str]:
        """The pods there now and their addresses ("" before they have one)."""
        params = {"labelSelector": self.selector} if self.selector else {}
        return {p["metadata"]["name"]: (p.get("status") or {}).get("podIP", "")
                for p in self.kube.list(api_path("v1", "pods", self.namespace), **params)}

    def lines(self) -> list[LogLine]:
        """Every pod's lines so far, merged by time."""
        for pod in self.pods():
            path = api_path("v1", "pods", self.namespace, pod, subresource="log")
            try:
                text = self.kube.get_text(f"{path}?timestamps=true")
            except (ApiError, OSError):  # no container started yet, or gone meanwhile
                continue
            self.seen[pod] = parse_api_log(text, pod)
        return merge(self.seen.values())
