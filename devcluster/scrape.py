"""Read a Prometheus text exposition over HTTP, as the demo and its test do."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    """The samples of one scrape: (name, labels, value)."""

    samples: tuple[tuple[str, dict[str, str], float], ...]

    def get(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
        return sum(value for n, have, value in self.samples
                   if n == name and labels.items() <= have.items())

    def has(self, name: str) -> bool:
        """Whether any sample is called ``name``."""
        return any(n == name for n, _, _ in self.samples)


def parse(text: str) -> Scrape:
    """Parse the text format with prometheus_client's own parser (strict about syntax)."""
    return Scrape(tuple((s.name, dict(s.labels), float(s.value))
                        for family in text_string_to_metric_families(text)
                        for s in family.samples))


def scrape(url: str, timeout: float = 3.0, patience: float = 0.0) -> Scrape | None:
    """GET ``url`` and parse it; None when nothing answers there. With ``patience``, asks
    again for that many seconds: a busy process's metrics thread can miss one timeout."""
    deadline = time.monotonic() + patience
    while True:
        try:
            resp = httpx.get(url, timeout=timeout)
            if resp.status_code == 200:
                return parse(resp.text)
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
