"""A real Prometheus for the local cluster: scrapes the operator and the training pods.

The training pods are found the way the chart's PodMonitor finds them: Kubernetes
service discovery (role ``pod``) through the API server, keeping pods that carry the
job label and scraping their container port named ``metrics``. Pod IPs are loopback
addresses, so the runtime processes standing in for the pods answer there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import yaml

from .control_plane import free_port
from .local_server import LocalServer

JOB_LABEL_META = "__meta_kubernetes_pod_label_ringwright_dev_job"
"""The Kubernetes SD label of ``ringwright.dev/job``."""


def config(operator_target: str, kubeconfig: Path, namespaces: list[str],
           interval: str = "1s") -> dict[str, Any]:
    """The scrape configuration: the operator by address, the training pods by discovery."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": "ringwright-operator",
             "static_configs": [{"targets": [operator_target]}]},
            {"job_name": "ringwright-training",
             "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig),
                                        "namespaces": {"names": namespaces}}],
             "relabel_configs": [
                 {"source_labels": [JOB_LABEL_META], "regex": ".+", "action": "keep"},
                 {"source_labels": ["__meta_kubernetes_pod_container_port_name"],
                  "regex": "metrics", "action": "keep"},
                 {"source_labels": [JOB_LABEL_META], "target_label": "job_name"},
                 {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                 {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
             ]},
        ],
    }


class Prometheus:
    """One Prometheus process with its own data folder, on a free loopback port."""

    def __init__(self, binary: Path, workdir: Path, scrape_config: dict[str, Any]) -> None:
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(scrape_config))
        self._server = LocalServer("prometheus", workdir / "prometheus.log")

    def start(self, timeout: float = 60.0) -> None:
        """Start and wait until it reports ready."""
        self._server.start(
            [str(self.binary), f"--config.file={self.config_file}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            f"{self.url}/-/ready", timeout)

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query through the HTTP API: (labels, value) per series."""
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        resp.raise_for_status()
        body = resp.json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return [(dict(r["metric"]), float(r["value"][1])) for r in body["data"]["result"]]

    def value(self, promql: str) -> float | None:
        """The single value of a query that yields one series; None when it yields none."""
        result = self.query(promql)
        return result[0][1] if result else None

    def stop(self) -> None:
        """Stop the process."""
        self._server.stop()
