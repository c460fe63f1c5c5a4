"""Test certificates from trustme: a CA, a server certificate for 127.0.0.1 and localhost,
and client certificates, written as PEM files for the server's flags and the clients."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass
class Certs:
    ca: trustme.CA
    ca_file: Path  # the CA that signed everything below
    server_cert: Path  # chain for 127.0.0.1, ::1 and localhost
    server_key: Path
    client_cert: Path  # CN "billing-service", signed by the CA
    client_key: Path
    directory: Path

    def server_flags(self, **extra: str) -> dict[str, str]:
        return {"tls_cert": str(self.server_cert), "tls_key": str(self.server_key), **extra}

    def client(self, name: str) -> tuple[Path, Path]:
        """A further client certificate (CN ``name``) and its key."""
        issued = self.ca.issue_cert(f"{name}.example.org", common_name=name)
        cert, key = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        issued.private_key_pem.write_to_path(str(key))
        cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
        return cert, key


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "::1", "localhost")
    paths = {name: directory / name for name in ("ca.pem", "server.pem", "server.key")}
    ca.cert_pem.write_to_path(str(paths["ca.pem"]))
    server.private_key_pem.write_to_path(str(paths["server.key"]))
    paths["server.pem"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    certs = Certs(ca, paths["ca.pem"], paths["server.pem"], paths["server.key"], Path(), Path(), directory)
    certs.client_cert, certs.client_key = certs.client("billing-service")
    return certs
