"""TLS for the router's two APIs: what the router is given (TLSConfig: the paths of PEM files on the router's
node, read when the servers start), the checks that make a bad file fail at start-up with a message naming it
instead of at every client's handshake, and the credentials each server library wants (gRPC: bytes; uvicorn:
file paths). With client_ca_file set, both APIs require a client certificate that CA signed (mutual TLS)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


class TLSFileError(ValueError):
    """A TLS file that cannot be used. field: which one ("cert_file", "key_file", "client_ca_file", or a client's
    "ca_file"), for messages that point at the manifest key."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TLSConfig:
    """cert_file: the certificate chain the router presents (PEM, its own certificate first); key_file: that
    certificate's private key (PEM, not encrypted: gRPC cannot use an encrypted key); client_ca_file: when set,
    clients must present a certificate this CA signed. Paths on the router's node, absolute (the router's working
    directory need not be the user's)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def check(self) -> None:
        """Reads and parses every file; the key must be the certificate's. Raises TLSFileError naming the first
        unusable one."""
        check_certificates(self.cert_file, "cert_file")
        key = _read(self.key_file, "key_file")
        if b"ENCRYPTED" in key:
            raise TLSFileError("key_file", f"{self.key_file} is an encrypted private key, which gRPC cannot use; "
                                           f"decrypt it (openssl pkey -in KEY -out PLAIN_KEY) and keep it readable "
                                           f"only by the user that runs tandem")
        if b"PRIVATE KEY-----" not in key:
            raise TLSFileError("key_file", f"{self.key_file} holds no PEM private key")
        try:  # an empty password: never let OpenSSL prompt on a terminal for one
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert_file, self.key_file, password="")
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise TLSFileError("key_file", f"{self.key_file} is not the private key of the certificate in "
                                               f"{self.cert_file}") from None
            raise TLSFileError("key_file", f"{self.key_file} is not a usable PEM private key ({e})") from None
        if self.client_ca_file is not None:
            check_certificates(self.client_ca_file, "client_ca_file")


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TLSFileError(field, f"cannot read {path}: {e.strerror}") from None


def check_certificates(path: str, field: str) -> bytes:
    """The PEM certificate(s) in path, as bytes. Raises TLSFileError if the file cannot be read or holds none."""
    data = _read(path, field)
    try:
        ssl.create_default_context().load_verify_locations(cadata=data.decode("ascii", "replace"))
    except ssl.SSLError:
        raise TLSFileError(field, f"{path} holds no valid PEM certificate (-----BEGIN CERTIFICATE-----)") from None
    return data


def grpc_server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """The gRPC server's credentials; a client certificate is required when tls.client_ca_file is set. Raises
    TLSFileError for an unusable file."""
    import grpc  # here: TLSConfig crosses to the control plane, which need not load gRPC for it

    tls.check()
    client_ca = None if tls.client_ca_file is None else _read(tls.client_ca_file, "client_ca_file")
    return grpc.ssl_server_credentials([(_read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file"))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def uvicorn_ssl_options(tls: TLSConfig) -> dict[str, object]:
    """uvicorn.Config's keyword arguments that make it serve https (requiring a client certificate when
    tls.client_ca_file is set). Raises TLSFileError for an unusable file."""
    tls.check()
    return {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file, "ssl_ca_certs": tls.client_ca_file,
            "ssl_cert_reqs": ssl.CERT_NONE if tls.client_ca_file is None else ssl.CERT_REQUIRED}
