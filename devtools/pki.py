"""A test PKI made with openssl at run time: a CA, another CA, and certificates for the
broker (127.0.0.1 and localhost), a client (CN tls-worker) and a host the broker is not."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return key, cert


def _signed(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    ext.write_text(extensions + "\nauthorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca[1], "-CAkey", ca[0], "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", ext,
    )  # fmt: skip
    return key, cert


@dataclass
class Pki:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path  # CN "tls-worker", signed by ca
    client_key: Path
    misnamed_cert: Path  # signed by ca, for broker.example only
    misnamed_key: Path


def make_pki(directory: Path) -> Pki:
    ca = _ca(directory, "test-ca")
    other = _ca(directory, "other-ca")
    server = _signed(
        directory,
        "localhost",
        ca,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth",
    )
    client = _signed(directory, "tls-worker", ca, "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth")
    misnamed = _signed(directory, "misnamed", ca, "subjectAltName=DNS:broker.example\nextendedKeyUsage=serverAuth")
    return Pki(ca[1], other[1], server[1], server[0], client[1], client[0], misnamed[1], misnamed[0])


def tls_listener(port: int, pki: Pki) -> str:
    """mosquitto.conf lines of a TLS listener on loopback with the broker's certificate."""
    return f"listener {port} 127.0.0.1\ncafile {pki.ca}\ncertfile {pki.server_cert}\nkeyfile {pki.server_key}\n"
