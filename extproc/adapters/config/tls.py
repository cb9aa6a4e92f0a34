"""``listen.tls``'s files loaded into a server context, each bad file named by its key.

The config's rules load them once when the file is checked (``rules.py``), so
``extproc check-config`` names a missing file, a certificate that is not PEM or
a key that does not match by its key path; the gRPC listener loads them the
same way when it starts and whenever they change (``adapters/grpc/tls.py``).
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

# TLS 1.2 suites HTTP/2 allows (RFC 9113, 9.2.2: ephemeral key exchange, AEAD); TLS 1.3's are all allowed.
H2_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class TlsFileError(ValueError):
    """A file of the TLS settings is missing or does not load; ``key`` names its setting (``cert_file``, ...)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class _Encrypted(Exception):
    """Raised for OpenSSL's password prompt, which would otherwise wait on the terminal."""


def _no_password() -> str:
    raise _Encrypted


def _why(exc: Exception) -> str:
    """OpenSSL's reason, without CPython's source location."""
    return re.sub(r" \(_ssl\.c:\d+\)$", "", str(exc))


def load_context(cert_file: str, key_file: str, client_ca_file: str | None) -> ssl.SSLContext:
    """A server context for gRPC (TLS 1.2+, ALPN h2) from the files; :class:`TlsFileError` names the bad one.

    With ``client_ca_file``, a client must present a certificate it signed.
    """
    files = {"cert_file": cert_file, "key_file": key_file, "client_ca_file": client_ca_file}
    for key, path in files.items():
        if path is not None and not Path(path).is_file():
            raise TlsFileError(key, f"file not found: {path}")
    # The certificate file alone first, so that a later failure can only be the key's.
    for key, path in (("cert_file", cert_file), ("client_ca_file", client_ca_file)):
        if path is not None:
            try:
                ssl.create_default_context(cafile=path)
            except (ssl.SSLError, ValueError) as exc:
                raise TlsFileError(key, f"not a PEM certificate: {path} ({_why(exc)})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(H2_TLS12_CIPHERS)
    context.set_alpn_protocols(["h2"])
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except _Encrypted:
        raise TlsFileError("key_file", f"is encrypted (a key without a password is needed): {key_file}") from None
    except ssl.SSLError as exc:
        problem = "does not match cert_file" if exc.reason == "KEY_VALUES_MISMATCH" else "not a PEM private key"
        raise TlsFileError("key_file", f"{problem}: {key_file} ({_why(exc)})") from None
    if client_ca_file is not None:
        context.load_verify_locations(cafile=client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
