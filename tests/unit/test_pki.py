"""The local control plane's certificates: a serving certificate made before real
nodes (without the ``kubernetes`` Service's address) is signed anew by the same CA."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ringwright.devcluster.pki import SERVICE_IP, ensure_pki, names_service_ip


def test_a_serving_certificate_without_the_service_address_is_signed_anew(
    tmp_path: Path,
) -> None:
    first = ensure_pki(tmp_path)
    assert names_service_ip(tmp_path)
    # What an older checkout made: the same CA, no 10.96.0.1.
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    subprocess.run(["openssl", "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt",
                    "-CAkey", "ca.key", "-CAcreateserial", "-days", "1", "-extfile",
                    "san.ext", "-out", "apiserver.crt"], cwd=tmp_path, check=True,
                   capture_output=True)
    assert not names_service_ip(tmp_path)
    ca = (tmp_path / "ca.crt").read_bytes()

    again = ensure_pki(tmp_path)
    assert names_service_ip(tmp_path), f"{SERVICE_IP} still missing"
    assert (tmp_path / "ca.crt").read_bytes() == ca
    assert again.admin_token == first.admin_token
    verified = subprocess.run(["openssl", "verify", "-CAfile", "ca.crt", "apiserver.crt"],
                              cwd=tmp_path, capture_output=True, text=True, check=False)
    assert verified.returncode == 0, verified.stderr
