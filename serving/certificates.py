"""A private CA and certificates signed by it, for TLS and mutual TLS on one machine (the tests, the
memory probe, a first try of `--tls-cert` / `--tls-client-ca`). Made with the `openssl` command, EC
keys on P-256, valid for `days` days; the server certificate names 127.0.0.1 and localhost. Not a
way to run a public service: a deployment's certificates come from its own CA."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


class CertificateToolMissing(RuntimeError):
    """The `openssl` command is not on the PATH."""


def make_local_certificates(root: Path, *, days: int = 2) -> dict[str, Path]:
    """Write into `root` a CA (ca.pem), a server certificate for 127.0.0.1 / localhost and a client
    certificate (extended key usage clientAuth), both signed by that CA, with their keys, and a
    second CA (other_ca.pem) that signed nothing. Paths by name: ca, other_ca, server, server_key,
    client, client_key."""
    if shutil.which("openssl") is None:
        raise CertificateToolMissing("making certificates needs the openssl command on the PATH")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        done = subprocess.run(["openssl", *args], check=False, cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[:200]}")

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other_ca"):
        run("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", str(days),
            "-subj", f"/CN={ca}")
    (root / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (root / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", str(days), "-extfile", f"{name}.ext")
    return {"ca": root / "ca.pem", "other_ca": root / "other_ca.pem", "server": root / "server.pem",
            "server_key": root / "server.key", "client": root / "client.pem", "client_key": root / "client.key"}
