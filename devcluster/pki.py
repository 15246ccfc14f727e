"""Certificates and keys for the local control plane, made with the openssl CLI.

One CA signs the API server's serving certificate (valid for 127.0.0.1, localhost and
the ``kubernetes`` Service's address, where real nodes' pods reach it);
an RSA key pair signs and verifies ServiceAccount tokens; a static bearer token
authenticates the admin and the control-plane components.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE_IP = "10.96.0.1"
"""The ``kubernetes`` Service's cluster IP: the first of the API server's
``--service-cluster-ip-range``; in-cluster clients (pods on real nodes) dial it."""


@dataclass(frozen=True)
class Pki:
    """Paths of the generated material inside a cluster's state folder."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path
    token_file: Path
    admin_token: str


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("openssl is not on PATH; install it (Debian: apt-get install openssl)")
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr[-2000:]}")


def _openssl_out(*args: str) -> str:
    exe = shutil.which("openssl") or "openssl"
    proc = subprocess.run([exe, *args], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""


def names_service_ip(folder: Path) -> bool:
    """Whether the API server's certificate in ``folder`` is valid for
    :data:`SERVICE_IP` (one made by an older checkout, before real nodes, is not)."""
    cert = folder / "apiserver.crt"
    return cert.is_file() and f"IP Address:{SERVICE_IP}" in _openssl_out(
        "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName")


def _sign_serving_cert(folder: Path) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key",
             "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver", cwd=folder)
    (folder / "san.ext").write_text(
        f"subjectAltName=IP:127.0.0.1,IP:{SERVICE_IP},DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
    )
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "3650", "-extfile", "san.ext",
             "-out", "apiserver.crt", cwd=folder)


def ensure_pki(folder: Path) -> Pki:
    """Create the material in ``folder`` unless it is already there; return its paths.
    A serving certificate that does not name :data:`SERVICE_IP` is signed anew (same
    CA, so kubeconfigs stay valid)."""
    folder.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=folder / "ca.crt",
        serving_cert=folder / "apiserver.crt",
        serving_key=folder / "apiserver.key",
        sa_key=folder / "sa.key",
        sa_pub=folder / "sa.pub",
        token_file=folder / "tokens.csv",
        admin_token="",
    )
    if not pki.token_file.exists():
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
                 "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=ringwright-devcluster-ca",
                 cwd=folder)
        _sign_serving_cert(folder)
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)
        token = secrets.token_hex(24)
        # Static token file: token,user,uid,"group1,group2".
        pki.token_file.write_text(f'{token},ringwright-admin,ringwright-admin,"system:masters"\n')
        pki.token_file.chmod(0o600)
    elif not names_service_ip(folder):
        _sign_serving_cert(folder)
    token = pki.token_file.read_text().split(",", 1)[0]
    return Pki(**{**pki.__dict__, "admin_token": token})
