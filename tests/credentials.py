"""Kubeconfigs for tests: a token file, or an exec plugin (a tiny script printing an
ExecCredential, as ``aws eks get-token`` or ``gke-gcloud-auth-plugin`` would)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

EXEC_PLUGIN = '''\
import json, pathlib, sys
token = pathlib.Path(sys.argv[1]).read_text().strip()
# One line per call, appended: clients of one process may run the plugin at once.
with open(sys.argv[1] + ".calls", "a") as calls:
    calls.write("called\\n")
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {"token": token}}))
'''


def exec_calls(token_file: Path) -> int:
    """How many times the exec plugin reading ``token_file`` has run."""
    calls = token_file.with_name(token_file.name + ".calls")
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any],
               namespace: str = "default") -> Path:
    """Write a one-context kubeconfig with ``cluster`` and ``user`` stanzas."""
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u",
                                                  "namespace": namespace}}],
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


def exec_user(folder: Path, token_file: Path) -> dict[str, Any]:
    """A kubeconfig ``user`` whose token comes from an exec plugin reading ``token_file``."""
    script = folder / "exec-credential.py"
    script.write_text(EXEC_PLUGIN)
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                     "command": sys.executable, "args": [str(script), str(token_file)],
                     "interactiveMode": "Never"}}
