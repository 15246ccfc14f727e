"""A thin, typed helper over the official ``kubernetes`` client, shared by the operator's
apply layer, the runtime's membership source and reporter, the local control plane and
the tests.

The official client does the parts that must follow Kubernetes exactly: kubeconfig
loading (exec plugins such as ``aws eks get-token`` or ``gke-gcloud-auth-plugin``, OIDC
auth providers, token files, client certificates), the in-cluster ServiceAccount, TLS
and the connection pool. This module adds what ringwright's callers want on top:
paths instead of one generated method per resource, objects as ``dict[str, Any]``
(manifests are built as whole dictionaries by pure builders), credentials re-read when
the server says 401 (tokens rotate), 429 and 5xx answers retried after their
``Retry-After``, and lists fetched page by page.
"""

from __future__ import annotations

import builtins
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import urllib3
import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.watch.watch import iter_resp_lines

from .objects import Obj

Params = Mapping[str, str | int | bool]

FIELD_MANAGER = "ringwright"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_ACCOUNT_DIR_ENV = "RINGWRIGHT_SERVICE_ACCOUNT_DIR"
"""Where the in-cluster ServiceAccount (token, ca.crt, namespace) is mounted, when a
pod mounts a projected token elsewhere; default :data:`SERVICE_ACCOUNT_DIR`."""
LIST_PAGE_SIZE = 500
"""Items per page of a LIST (what kubectl and client-go's pager use)."""
POOL_SIZE = 64
"""Connections kept open to the API server (the official default is 5 per CPU)."""
TOKEN_REREAD_SECONDS = 60.0
"""How often a token read from a file (in-cluster, ``tokenFile``) is read again."""


class ApiError(Exception):
    """A non-success answer from the API server, with its reason and message."""

    def __init__(self, status: int, reason: str, message: str, where: str,
                 causes: tuple[str, ...] = ()) -> None:
        super().__init__(f"{where}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.verb = where.split(" ", 1)[0]
        """The request's method (GET, POST, PATCH, DELETE, WATCH)."""
        self.causes = causes
        """The ``details.causes[].reason`` of the Status (e.g. ``NamespaceTerminating``)."""


class Unreachable(ApiError):
    """The API server could not be reached, or the connection broke (status 0)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(0, "Unreachable", message, where)


@dataclass(frozen=True)
class KubeconfigFile:
    """Credentials come from a kubeconfig file (loaded again when they go stale)."""

    path: str
    context: str | None = None


@dataclass(frozen=True)
class InCluster:
    """Credentials come from a pod's mounted ServiceAccount (the token rotates)."""

    sa_dir: Path = SERVICE_ACCOUNT_DIR


ConfigSource = KubeconfigFile | InCluster


@dataclass(frozen=True)
class KubeConfig:
    """How to reach and authenticate to one API server.

    ``source`` says where the credentials came from, so a client can load them again
    when the server refuses them; None for a config built by hand.
    """

    server: str
    token: str = ""
    ca_file: str = ""
    client_cert_file: str = ""
    client_key_file: str = ""
    insecure: bool = False
    namespace: str = "default"
    tls_server_name: str = ""
    source: ConfigSource | None = field(default=None, compare=False)

    def reloaded(self) -> KubeConfig:
        """The same config with its credentials loaded again from ``source``."""
        if isinstance(self.source, KubeconfigFile):
            return load_kubeconfig(self.source.path, self.source.context)
        if isinstance(self.source, InCluster):
            return in_cluster_config(self.source.sa_dir)
        return self

    def rereads_token(self) -> bool:
        """Whether the token lives in a file that may change under us."""
        if isinstance(self.source, InCluster):
            return True
        if isinstance(self.source, KubeconfigFile):
            return _kubeconfig_user(self.source.path, self.source.context).get(
                "tokenFile") is not None
        return False


def _kubeconfig_doc(path: str | os.PathLike[str]) -> Obj:
    doc: Obj = yaml.safe_load(Path(path).read_text()) or {}
    return doc


def _context_of(doc: Obj, context: str | None) -> Obj:
    name = context or doc.get("current-context", "")
    contexts = {c["name"]: c.get("context") or {} for c in doc.get("contexts") or []}
    if name not in contexts:
        raise ValueError(f"kubeconfig context {name!r} not found; set current-context")
    ctx: Obj = contexts[name]
    return ctx


def _kubeconfig_user(path: str | os.PathLike[str], context: str | None) -> Obj:
    doc = _kubeconfig_doc(path)
    user_name = _context_of(doc, context).get("user", "")
    users = {u["name"]: u.get("user") or {} for u in doc.get("users") or []}
    user: Obj = users.get(user_name, {})
    return user


def _from_official(cfg: k8s_client.Configuration, namespace: str,
                   source: ConfigSource) -> KubeConfig:
    bearer = str(cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization") or "")
    token = bearer.split(" ", 1)[1] if " " in bearer else bearer
    return KubeConfig(
        server=str(cfg.host),
        token=token.strip(),
        ca_file=str(cfg.ssl_ca_cert or ""),
        client_cert_file=str(cfg.cert_file or ""),
        client_key_file=str(cfg.key_file or ""),
        insecure=not cfg.verify_ssl,
        namespace=namespace or "default",
        tls_server_name=str(getattr(cfg, "tls_server_name", None) or ""),
        source=source,
    )


def load_kubeconfig(path: str | os.PathLike[str], context: str | None = None) -> KubeConfig:
    """Read a kubeconfig file with the official loader.

    Token, token-file, client-certificate, exec-plugin and OIDC users all work: an
    exec plugin runs now, and again whenever a client reloads the config after a 401.
    """
    doc = _kubeconfig_doc(path)
    ctx = _context_of(doc, context)
    cfg = k8s_client.Configuration()
    try:
        k8s_config.load_kube_config(config_file=str(path), context=context,
                                    client_configuration=cfg, persist_config=False)
    except k8s_config.ConfigException as err:
        raise ValueError(f"{path}: {err}") from err
    return _from_official(cfg, str(ctx.get("namespace") or "default"),
                          KubeconfigFile(str(path), context))


def in_cluster_config(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """Config from a pod's mounted ServiceAccount (host and port from the environment)."""
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):
        raise ValueError("not in a cluster: KUBERNETES_SERVICE_HOST is unset")
    cfg = k8s_client.Configuration()
    loader = k8s_config.incluster_config.InClusterConfigLoader(
        token_filename=str(sa_dir / "token"), cert_filename=str(sa_dir / "ca.crt"),
        try_refresh_token=False)
    try:
        loader.load_and_set(cfg)
    except k8s_config.ConfigException as err:
        raise ValueError(f"in-cluster config: {err}") from err
    return _from_official(cfg, (sa_dir / "namespace").read_text().strip(), InCluster(sa_dir))


def default_config() -> KubeConfig:
    """``$KUBECONFIG`` (first file), else in-cluster, else ``~/.kube/config``."""
    env = os.environ.get("KUBECONFIG", "")
    if env:
        return load_kubeconfig(env.split(os.pathsep)[0])
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_config(Path(os.environ.get(SERVICE_ACCOUNT_DIR_ENV)
                                      or SERVICE_ACCOUNT_DIR))
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


@dataclass(frozen=True)
class RetryPolicy:
    """When a refused or failed request is tried again (client-go's rules, bounded)."""

    attempts: int = 6
    backoff_s: float = 0.2
    max_wait_s: float = 10.0

    def wait(self, status: int, method: str, retry_after: str | None,
             attempt: int) -> float | None:
        """Seconds to wait before another try, or None to give up.

        429 means the request was not processed, so any verb is retried; a 5xx only when
        the server named a Retry-After or the verb is a read (a write may have happened).
        """
        if attempt + 1 >= self.attempts:
            return None
        if status != 429 and not (status >= 500 and (retry_after or method == "GET")):
            return None
        try:
            seconds = float(retry_after) if retry_after else 0.0
        except ValueError:
            seconds = 0.0
        if seconds <= 0:
            seconds = self.backoff_s * 2 ** attempt
        return min(seconds, self.max_wait_s)


class KubeClient:
    """Synchronous client over the official one; safe to share between threads."""

    def __init__(self, config: KubeConfig, *, timeout: float = 30.0,
                 retry: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._retry, self._sleep, self._clock = retry, sleep, clock
        self._lock = threading.Lock()
        self._streams: set[urllib3.BaseHTTPResponse] = set()
        self._closed = False
        self._set_config(config)
        self._file_token = config.rereads_token()

    @property
    def config(self) -> KubeConfig:
        """The config in use (credentials as last loaded)."""
        return self._config

    def _set_config(self, config: KubeConfig) -> None:
        official = k8s_client.Configuration()
        official.host = config.server
        official.verify_ssl = not config.insecure
        official.ssl_ca_cert = config.ca_file or None
        official.cert_file = config.client_cert_file or None
        official.key_file = config.client_key_file or None
        if config.tls_server_name:
            official.tls_server_name = config.tls_server_name
        # The official client adds its own read retries on connection errors only.
        official.retries = 3 if self._retry.attempts > 1 else 0
        # Room for the apply layer's 64 concurrent creates without reconnecting.
        official.connection_pool_maxsize = POOL_SIZE
        api = k8s_client.ApiClient(official)
        with self._lock:
            old = getattr(self, "_api", None)
            self._config, self._api, self._loaded_at = config, api, self._clock()
        if old is not None:
            old.close()

    def _refresh(self) -> None:
        """Load the credentials again (a rotated token, a fresh exec-plugin answer)."""
        self._set_config(self._config.reloaded())

    def close(self) -> None:
        """Close the connection pool and cut any open watch stream."""
        with self._lock:
            self._closed = True
            streams = list(self._streams)
        for stream in streams:
            stream.shutdown()
        self._api.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: Obj | None, params: Params | None,
              content_type: str, timeout: float | tuple[float, float]
              ) -> urllib3.BaseHTTPResponse:
        """One request with the current credentials; the raw (unread) response."""
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._file_token and self._clock() - self._loaded_at >= TOKEN_REREAD_SECONDS:
            self._refresh()
        headers = {"Accept": "application/json"}
        if self._config.token:
            headers["Authorization"] = f"Bearer {self._config.token}"
        if body is not None:
            headers["Content-Type"] = content_type
        query = urllib.parse.urlencode(
            {k: (str(v).lower() if isinstance(v, bool) else str(v))
             for k, v in (params or {}).items()})
        url = self._config.server.rstrip("/") + path + (f"?{query}" if query else "")
        try:
            # A dict body: the official REST layer serializes JSON and YAML (apply) alike.
            resp = self._api.call_api(method, url, header_params=headers, body=body,
                                      _request_timeout=timeout)
        except (urllib3.exceptions.HTTPError, k8s_client.ApiException, OSError) as err:
            raise Unreachable(str(err), f"{method} {path}") from err
        raw: urllib3.BaseHTTPResponse = resp.response
        return raw

    def _request(self, method: str, path: str, *, body: Obj | None = None,
                 params: Params | None = None, content_type: str = "application/json",
                 timeout: float | tuple[float, float] | None = None
                 ) -> urllib3.BaseHTTPResponse:
        """Send with credential refresh on 401 and retries on 429/5xx; errors raised."""
        where = f"{method} {path}"
        refreshed = False
        attempt = 0
        while True:
            resp = self._send(method, path, body, params, content_type,
                              timeout if timeout is not None else self.timeout)
            if resp.status < 400:
                return resp
            data = resp.data
            resp.release_conn()
            if resp.status == 401 and not refreshed and self._config.source is not None:
                refreshed = True
                self._refresh()
                continue
            wait = self._retry.wait(resp.status, method, resp.headers.get("Retry-After"),
                                    attempt)
            if wait is None:
                raise _error(resp.status, data, where)
            attempt += 1
            self._sleep(wait)

    def _call(self, method: str, path: str, *, body: Obj | None = None,
              params: Params | None = None, content_type: str = "application/json") -> Obj:
        resp = self._request(method, path, body=body, params=params, content_type=content_type)
        return _decode(resp.data)

    def get(self, path: str, **params: str | int | bool) -> Obj:
        """GET an object or a collection (one response, no paging)."""
        return self._call("GET", path, params=params)

    def get_text(self, path: str) -> str:
        """GET a non-JSON endpoint (``/metrics``, ``/readyz``) as text."""
        resp = self._request("GET", path)
        return resp.data.decode(errors="replace")

    def get_or_none(self, path: str) -> Obj | None:
        """GET an object, or None when it does not exist."""
        try:
            return self.get(path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, path: str, **params: str | int | bool) -> list[Obj]:
        """Every item of a collection, fetched in pages of :data:`LIST_PAGE_SIZE`."""
        return self.list_with_version(path, **params)[0]

    def list_with_version(self, path: str, **params: str | int | bool
                          ) -> tuple[builtins.list[Obj], str]:
        """Every item of a collection and the list's resourceVersion (to watch from).

        When a continue token expires mid-way (410), the list starts over unpaged, as
        client-go's pager does, so the result is always one consistent snapshot.
        """
        items: builtins.list[Obj] = []
        token = ""
        while True:
            query: dict[str, str | int | bool] = {**params, "limit": LIST_PAGE_SIZE}
            if token:
                query["continue"] = token
            try:
                page = self.get(path, **query)
            except ApiError as err:
                if err.status != 410 or not token:
                    raise
                page = self.get(path, **params)
                items, token = [], ""
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def create(self, path: str, body: Obj) -> Obj:
        """POST a new object into the collection at ``path``."""
        return self._call("POST", path, body=body)

    def replace(self, path: str, body: Obj) -> Obj:
        """PUT a whole object (its resourceVersion guards against lost updates)."""
        return self._call("PUT", path, body=body)

    def apply(self, path: str, body: Obj, *, force: bool = True,
              field_manager: str = FIELD_MANAGER) -> Obj:
        """Server-side apply of ``body`` at the object path, as ringwright's field manager."""
        return self._call("PATCH", path, body=body,
                          params={"fieldManager": field_manager, "force": force},
                          content_type="application/apply-patch+yaml")

    def merge_patch(self, path: str, body: Obj) -> Obj:
        """JSON merge patch (RFC 7386); writers of different keys never conflict."""
        return self._call("PATCH", path, body=body, params={"fieldManager": FIELD_MANAGER},
                          content_type="application/merge-patch+json")

    def delete(
        self, path: str, *, propagation: str = "Background", grace: int | None = None,
        precondition_uid: str | None = None,
    ) -> bool:
        """DELETE an object; False when it was already gone.

        ``precondition_uid`` deletes only that incarnation: a replacement created under the
        same name in the meantime is left alone (409 then counts as already gone).
        """
        body: Obj = {"propagationPolicy": propagation}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if precondition_uid:
            body["preconditions"] = {"uid": precondition_uid}
        try:
            self._call("DELETE", path, body=body)
        except ApiError as err:
            if err.status == 404 or (err.status == 409 and precondition_uid):
                return False
            raise
        return True

    def watch(
        self, path: str, *, resource_version: str = "", timeout_seconds: int = 300,
        **params: str
    ) -> Iterator[Obj]:
        """Stream watch events (``{"type", "object"}``) until the server ends the watch.

        ``close()`` from another thread cuts the stream; the iterator then ends with
        :class:`Unreachable`.
        """
        query: dict[str, str | int | bool] = {
            "watch": "1", "timeoutSeconds": timeout_seconds, "allowWatchBookmarks": True,
            **params,
        }
        if resource_version:
            query["resourceVersion"] = resource_version
        resp = self._request("GET", path, params=query,
                             timeout=(10.0, timeout_seconds + 10.0))
        with self._lock:
            self._streams.add(resp)
        try:
            for line in iter_resp_lines(resp):
                if line.strip():
                    event: Obj = json.loads(line)
                    yield event
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise Unreachable(str(err), f"WATCH {path}") from err
        finally:
            with self._lock:
                self._streams.discard(resp)
            resp.release_conn()


def _decode(data: bytes) -> Obj:
    if not data:
        return {}
    try:
        doc = json.loads(data)
    except ValueError:
        return {"message": data[:500].decode(errors="replace")}
    return doc if isinstance(doc, dict) else {"value": doc}


def _error(status: int, data: bytes, where: str) -> ApiError:
    doc = _decode(data)
    causes = tuple(str(c.get("reason") or c.get("type") or "")
                   for c in (doc.get("details") or {}).get("causes") or ())
    return ApiError(status, str(doc.get("reason", "")), str(doc.get("message", "")), where,
                    causes)


def with_token(config: KubeConfig, token: str) -> KubeConfig:
    """``config`` authenticating with ``token`` instead (and not reloading its own)."""
    return replace(config, token=token, client_cert_file="", client_key_file="", source=None)
