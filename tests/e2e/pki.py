"""The key material of a throwaway control plane, made with the `openssl` command (the `cryptography`
package is not a dependency): a CA, an API server certificate it signs, a service-account key pair."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "2"  # a test session lasts minutes; nothing outlives it


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    service_account_key: Path
    service_account_public_key: Path


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


def make_pki(directory: Path) -> Pki:
    """Write the CA, the serving certificate (for 127.0.0.1, localhost and the in-cluster names) and
    the service-account signing key pair into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        server_cert=directory / "apiserver.crt",
        server_key=directory / "apiserver.key",
        service_account_key=directory / "sa.key",
        service_account_public_key=directory / "sa.pub",
    )
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", DAYS,
        "-subj", "/CN=kvasir-e2e-ca", "-keyout", str(pki.ca_key), "-out", str(pki.ca_cert),
    )  # fmt: skip
    csr = directory / "apiserver.csr"
    _openssl(
        "req", "-new", "-newkey", "rsa:2048", "-nodes",
        "-subj", "/CN=kube-apiserver", "-keyout", str(pki.server_key), "-out", str(csr),
    )  # fmt: skip
    # Clients check the address they dialled against the SANs; in-cluster clients dial the Service names.
    names = "kubernetes,kubernetes.default,kubernetes.default.svc,kubernetes.default.svc.cluster.local"
    extensions = directory / "apiserver.ext"
    extensions.write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,"
        + ",".join(f"DNS:{name}" for name in names.split(","))
        + "\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key),
        "-CAcreateserial", "-days", DAYS, "-extfile", str(extensions), "-out", str(pki.server_cert),
    )  # fmt: skip
    _openssl("genrsa", "-out", str(pki.service_account_key), "2048")
    _openssl(
        "rsa", "-in", str(pki.service_account_key), "-pubout", "-out", str(pki.service_account_public_key)
    )
    return pki


def make_client_cert(pki: Pki, directory: Path, name: str, user: str, group: str = "") -> tuple[Path, Path]:
    """A client certificate the CA signs for `user` (CN) in `group` (O): the API server authenticates
    it as that user. Returns (certificate, key) written as `directory/<name>.crt|.key`."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, csr = (directory / f"{name}.{suffix}" for suffix in ("crt", "key", "csr"))
    subject = f"/CN={user}" + (f"/O={group}" if group else "")
    _openssl(
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        subject,
        "-keyout",
        str(key),
        "-out",
        str(csr),
    )
    extensions = directory / f"{name}.ext"
    extensions.write_text("extendedKeyUsage=clientAuth\n")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key),
        "-CAcreateserial", "-days", DAYS, "-extfile", str(extensions), "-out", str(cert),
    )  # fmt: skip
    return cert, key
