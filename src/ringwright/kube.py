"""A small, typed Kubernetes REST client shared by the operator's apply layer,
the runtime's membership source, the local control plane and the tests.

It speaks plain JSON over HTTPS with bearer tokens or client certificates, which is
all ringwright needs: create, get, list, server-side apply, merge patch, delete and
watch. Objects stay ``dict[str, Any]`` because manifests are built as whole
dictionaries by pure builder functions.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

Obj = dict[str, Any]

FIELD_MANAGER = "ringwright"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ApiError(Exception):
    """A non-success answer from the API server, with its reason and message."""

    def __init__(self, status: int, reason: str, message: str, where: str) -> None:
        super().__init__(f"{where}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.verb = where.split(" ", 1)[0]
        """The request's method (GET, POST, PATCH, DELETE, WATCH)."""


@dataclass(frozen=True)
class KubeConfig:
    """How to reach and authenticate to one API server."""

    server: str
    token: str = ""
    ca_file: str = ""
    client_cert_file: str = ""
    client_key_file: str = ""
    insecure: bool = False
    namespace: str = "default"

    def ssl_context(self) -> ssl.SSLContext | bool:
        if self.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        if self.client_cert_file:
            ctx.load_cert_chain(self.client_cert_file, self.client_key_file or None)
        return ctx


def _materialize(data_b64: str, suffix: str) -> str:
    """Write inline kubeconfig data to a private temp file (ssl wants paths)."""
    fd, name = tempfile.mkstemp(prefix="ringwright-", suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(data_b64))
    return name


def load_kubeconfig(path: str | os.PathLike[str], context: str | None = None) -> KubeConfig:
    """Read a kubeconfig file (token, client-certificate or insecure clusters).

    Exec and auth-provider plugins are not supported: point ``KUBECONFIG`` at a file
    with a token or client certificate instead.
    """
    doc = yaml.safe_load(Path(path).read_text()) or {}
    ctx_name = context or doc.get("current-context", "")
    contexts = {c["name"]: c["context"] for c in doc.get("contexts") or []}
    if ctx_name not in contexts:
        raise ValueError(f"{path}: context {ctx_name!r} not found; set current-context")
    ctx = contexts[ctx_name]
    clusters = {c["name"]: c["cluster"] for c in doc.get("clusters") or []}
    users = {u["name"]: u.get("user") or {} for u in doc.get("users") or []}
    cluster = clusters[ctx["cluster"]]
    user = users.get(ctx.get("user", ""), {})
    if "exec" in user or "auth-provider" in user:
        raise ValueError(
            f"{path}: user {ctx.get('user')!r} uses an exec/auth-provider plugin, which "
            "ringwright's client does not run; use a token or client-certificate kubeconfig"
        )
    ca = cluster.get("certificate-authority", "")
    if cluster.get("certificate-authority-data"):
        ca = _materialize(cluster["certificate-authority-data"], ".crt")
    cert = user.get("client-certificate", "")
    if user.get("client-certificate-data"):
        cert = _materialize(user["client-certificate-data"], ".crt")
    key = user.get("client-key", "")
    if user.get("client-key-data"):
        key = _materialize(user["client-key-data"], ".key")
    token = user.get("token", "")
    if user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    return KubeConfig(
        server=cluster["server"],
        token=token,
        ca_file=ca,
        client_cert_file=cert,
        client_key_file=key,
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        namespace=ctx.get("namespace", "default"),
    )


def in_cluster_config(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """Config from a pod's mounted ServiceAccount."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("not in a cluster: KUBERNETES_SERVICE_HOST is unset")
    return KubeConfig(
        server=f"https://{host}:{port}",
        token=(sa_dir / "token").read_text().strip(),
        ca_file=str(sa_dir / "ca.crt"),
        namespace=(sa_dir / "namespace").read_text().strip(),
    )


def default_config() -> KubeConfig:
    """``$KUBECONFIG`` (first file), else in-cluster, else ``~/.kube/config``."""
    env = os.environ.get("KUBECONFIG", "")
    if env:
        return load_kubeconfig(env.split(os.pathsep)[0])
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_config()
    return load_kubeconfig(Path.home() / ".kube" / "config")


def api_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection, an object or an object's subresource."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    path = f"{base}{ns}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeClient:
    """Synchronous client; safe to share between threads (httpx pools connections)."""

    def __init__(self, config: KubeConfig, *, timeout: float = 30.0) -> None:
        self.config = config
        headers = {"Accept": "application/json"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self._http = httpx.Client(
            base_url=config.server,
            headers=headers,
            verify=config.ssl_context(),
            timeout=timeout,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Obj | None = None,
        params: Mapping[str, str | int | bool] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        content = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": content_type} if content is not None else {}
        resp = self._http.request(
            method, path, content=content, params=dict(params or {}), headers=headers
        )
        return _decode(resp, f"{method} {path}")

    def get(self, path: str, **params: str | int | bool) -> Obj:
        """GET an object or a collection."""
        return self._call("GET", path, params=params)

    def get_or_none(self, path: str) -> Obj | None:
        """GET an object, or None when it does not exist."""
        try:
            return self.get(path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, path: str, **params: str | int | bool) -> list[Obj]:
        """The items of a collection (one page; ringwright's collections are small)."""
        items: list[Obj] = self.get(path, **params).get("items") or []
        return items

    def create(self, path: str, body: Obj) -> Obj:
        """POST a new object into the collection at ``path``."""
        return self._call("POST", path, body=body)

    def replace(self, path: str, body: Obj) -> Obj:
        """PUT a whole object (its resourceVersion guards against lost updates)."""
        return self._call("PUT", path, body=body)

    def apply(self, path: str, body: Obj, *, force: bool = True) -> Obj:
        """Server-side apply of ``body`` at the object path, as ringwright's field manager."""
        return self._call(
            "PATCH",
            path,
            body=body,
            params={"fieldManager": FIELD_MANAGER, "force": force},
            content_type="application/apply-patch+yaml",
        )

    def merge_patch(self, path: str, body: Obj) -> Obj:
        """JSON merge patch (RFC 7386); writers of different keys never conflict."""
        return self._call(
            "PATCH",
            path,
            body=body,
            params={"fieldManager": FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )

    def delete(
        self, path: str, *, propagation: str = "Background", grace: int | None = None
    ) -> bool:
        """DELETE an object; False when it was already gone."""
        body: Obj = {"propagationPolicy": propagation}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            self._call("DELETE", path, body=body)
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    def watch(
        self, path: str, *, resource_version: str = "", timeout_seconds: int = 300, **params: str
    ) -> Iterator[Obj]:
        """Stream watch events (``{"type", "object"}``) until the server ends the watch."""
        query: dict[str, str | int | bool] = {
            "watch": "1",
            "timeoutSeconds": timeout_seconds,
            "allowWatchBookmarks": "true",
            **params,
        }
        if resource_version:
            query["resourceVersion"] = resource_version
        with self._http.stream(
            "GET", path, params=query, timeout=httpx.Timeout(10.0, read=timeout_seconds + 10)
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                _decode(resp, f"WATCH {path}")
            for line in resp.iter_lines():
                if line.strip():
                    event: Obj = json.loads(line)
                    yield event


def _decode(resp: httpx.Response, where: str) -> Obj:
    try:
        doc: Obj = resp.json() if resp.content else {}
    except ValueError:
        doc = {"message": resp.text[:500]}
    if resp.status_code >= 400:
        raise ApiError(
            resp.status_code, str(doc.get("reason", "")), str(doc.get("message", "")), where
        )
    return doc
