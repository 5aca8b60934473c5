"""Test material for a secured metrics endpoint: a throwaway PKI and an htpasswd file.

``make_pki(directory)`` runs the ``openssl`` CLI (skipped without it, failed under
``CI=true``) to make a CA, a server certificate for 127.0.0.1/localhost and a client
certificate, all signed by the CA, as deploy/README.md tells users to.
``write_htpasswd(path, users)`` writes ``user:bcrypt-hash`` lines, what ``htpasswd -nbB``
prints.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_stack import require_binary

_LEAF_EXTENSIONS = {
    "server": "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    "client": "extendedKeyUsage=clientAuth\n",
}


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files :func:`make_pki` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def run_openssl(*args: str, cwd: Path) -> None:
    """``openssl *args`` in ``cwd``; fails the test with openssl's message."""
    openssl = require_binary("openssl", package="openssl")
    r = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"openssl {' '.join(args)}: {r.stderr}"


def make_pki(directory: Path) -> Pki:
    """CA ``ca.pem``; ``server.pem``/``server.key`` (127.0.0.1); ``client.pem``/``client.key``."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run_openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=distmon test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    for name, extensions in _LEAF_EXTENSIONS.items():
        (directory / f"{name}.ext").write_text(extensions)
        run_openssl(
            "req",
            *ec,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=distmon test {name}",
            cwd=directory,
        )
        run_openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
            cwd=directory,
        )
    return Pki(
        directory / "ca.pem",
        directory / "server.pem",
        directory / "server.key",
        directory / "client.pem",
        directory / "client.key",
    )


def write_htpasswd(path: Path, users: dict[str, str], rounds: int = 4) -> Path:
    """``user:bcrypt-hash`` lines for ``users`` (name -> password); bcrypt cost ``rounds``."""
    bcrypt = pytest.importorskip("bcrypt")
    path.write_text(
        "".join(
            f"{user}:{bcrypt.hashpw(pw.encode(), bcrypt.gensalt(rounds)).decode()}\n"
            for user, pw in users.items()
        )
    )
    return path
