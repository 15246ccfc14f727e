"""The chart's metrics objects, rendered by the real helm: the operator's metrics
Service, the optional ServiceMonitor and PodMonitor, and the Grafana dashboard, whose
every query names metrics that the operator and the runtime really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringwright.devcluster.helm import CHART
from ringwright.objects import Obj
from ringwright.operator.metrics import OperatorMetrics
from ringwright.operator.plan.manifests import JOB_LABEL, METRICS_PORT_NAME, ROLE_LABEL
from ringwright.runtime.metrics import RuntimeMetrics
from ringwright.runtime.ps.metrics import PSMetrics
from tests.unit.test_chart_render import RELEASE_NS, by_kind, container, helm, one, render

__all__ = ["helm"]  # the fixture, shared with the chart render tests

ON = {"metrics": {"port": 9400, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                  "podMonitor": {"enabled": True}, "dashboard": {"enabled": True}}}


def test_by_default_a_metrics_service_and_no_monitors(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, tmp_path)
    service = one(objs, "Service")
    pod = one(objs, "Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9400,
                                         "targetPort": "metrics", "protocol": "TCP"}]
    assert "--metrics-port=9400" in container(objs)["args"]
    for kind in ("ServiceMonitor", "PodMonitor", "ConfigMap"):
        assert by_kind(objs, kind) == []


def test_port_zero_turns_operator_metrics_off(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, tmp_path, {"metrics": {"port": 0}})
    assert by_kind(objs, "Service") == []
    assert not any(a.startswith("--metrics-port") for a in container(objs)["args"])
    assert [p["name"] for p in container(objs)["ports"]] == ["health"]


def test_service_monitor_selects_the_metrics_service(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, tmp_path, ON)
    monitor = one(objs, "ServiceMonitor")
    service = one(objs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NS]}
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]


def _prometheus_label(key: str) -> str:
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def test_pod_monitor_scrapes_the_port_the_operator_gives_training_pods(
    helm: Path, tmp_path: Path
) -> None:
    monitor = one(render(helm, tmp_path, ON), "PodMonitor")["spec"]
    assert monitor["selector"] == {"matchExpressions": [{"key": JOB_LABEL,
                                                         "operator": "Exists"}]}
    assert monitor["namespaceSelector"] == {"any": True}
    endpoint = monitor["podMetricsEndpoints"][0]
    assert endpoint["port"] == METRICS_PORT_NAME
    sources = {r["sourceLabels"][0] for r in endpoint["relabelings"]}
    assert sources == {_prometheus_label(JOB_LABEL), _prometheus_label(ROLE_LABEL)}
    confined = one(render(helm, tmp_path, {**ON, "operator": {"watchNamespaces": ["a", "b"]}}),
                   "PodMonitor")["spec"]
    assert confined["namespaceSelector"] == {"matchNames": ["a", "b"]}


def _exported() -> set[str]:
    """Every sample name the operator, the runtime and the parameter servers expose."""
    names: set[str] = set()
    for registry in (OperatorMetrics().registry, RuntimeMetrics().registry,
                     PSMetrics().registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names.add(family.name)
            names |= {family.name + suffix for suffix in ("_total", "_bucket", "_sum",
                                                          "_count")}
    return names


def test_dashboard_queries_name_only_exported_metrics(helm: Path, tmp_path: Path) -> None:
    config_map = one(render(helm, tmp_path, ON), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard: Obj = json.loads(config_map["data"]["ringwright.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "ringwright.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bringwright_[a-z_]+", e)}
    assert used, "the dashboard has no queries"
    assert used <= _exported(), f"not exported: {sorted(used - _exported())}"
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Jobs by phase", "World size", "Recoveries", "Step time",
            "Checkpoint stall and write", "Heartbeat lag", "PS pushes and pulls",
            "Goodput", "Badput by phase"} <= titles
