"""TLS on the gRPC port: the listener's context, reloaded when its files change.

Gateway API Inference Extension gateways always speak TLS to their endpoint
picker (ALPN ``h2``), and an operator may ask clients for a certificate
(mutual TLS). The certificate, key and client CA come from files that
cert-manager or a Kubernetes Secret volume rewrite in place (a Secret swaps
the symlink of its ``..data`` directory), so the processor rereads them
without a restart: every ``reload_s`` it compares the resolved files'
contents with what it loaded, and loads the new pair into a fresh context.

The listener keeps one :class:`ssl.SSLContext`; its ``sni_callback`` (called
for every ClientHello, with or without SNI) moves each new handshake onto the
newest context, so new connections present the new certificate while open
connections keep their session. A replacement that does not load (a
half-written pair, a key that does not match) leaves the last good context
serving, with a warning; it is retried when the files change again.

OpenSSL reads the protocol versions and whether to ask for a client
certificate from the listener's context before the callback runs, so those
stay as configured at start (the CA itself is reloaded: verification reads
the switched-to context).
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

# TLS 1.2 suites HTTP/2 allows (RFC 9113, 9.2.2: ephemeral key exchange, AEAD); TLS 1.3's are all allowed.
H2_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
# What a reload can come to (the new files serve, or the previous ones still do).
RELOAD_OUTCOMES = ("ok", "failed")


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


class TlsFiles(Protocol):
    """What :class:`ServerTls` reads of its settings: the fields of the config's ``listen.tls`` (``TlsSettings``)."""

    @property
    def cert_file(self) -> str: ...
    @property
    def key_file(self) -> str: ...
    @property
    def client_ca_file(self) -> str | None: ...
    @property
    def reload_s(self) -> float: ...


class ServerTls:
    """The gRPC listener's TLS context (:attr:`listener`), switched to reloaded files for new handshakes.

    ``reloaded`` is told each reload's outcome, ``ok`` or ``failed`` (telemetry).
    """

    def __init__(self, settings: TlsFiles, reloaded: Callable[[str], None] = lambda outcome: None) -> None:
        self._reloaded = reloaded
        self.settings = settings
        self._paths = [p for p in (settings.cert_file, settings.key_file, settings.client_ca_file) if p is not None]
        self._loaded = self._contents()
        self.listener = self._load()
        self.current = self.listener
        self.listener.sni_callback = self._on_client_hello

    def _load(self) -> ssl.SSLContext:
        s = self.settings
        return load_context(s.cert_file, s.key_file, s.client_ca_file)

    def _contents(self) -> tuple[bytes | str, ...]:
        """What the files hold now (through any symlinks); an unreadable one stands as its error."""
        contents: list[bytes | str] = []
        for path in self._paths:
            try:
                contents.append(Path(path).read_bytes())
            except OSError as exc:
                contents.append(f"{type(exc).__name__}: {exc.strerror}")
        return tuple(contents)

    def _on_client_hello(self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
                         listener: ssl.SSLContext) -> None:
        if self.current is not listener:
            connection.context = self.current

    def check(self) -> str | None:
        """Reload if the files changed since the last look: ``ok``, ``failed`` (the old context stays), or None.

        The contents are read before loading; should the files change in
        between, the next check sees the difference and loads again.
        """
        contents = self._contents()
        if contents == self._loaded:
            return None
        self._loaded = contents  # a broken replacement is retried only once it changes again
        try:
            self.current = self._load()
        except TlsFileError as exc:
            log.warning("listen.tls.%s; still serving the previous certificate", exc)
            outcome = "failed"
        else:
            log.info("listen.tls: loaded the changed certificate files; new connections use them")
            outcome = "ok"
        self._reloaded(outcome)
        return outcome

    async def watch(self) -> None:
        """Check the files every ``reload_s``, until cancelled."""
        while True:
            await asyncio.sleep(self.settings.reload_s)
            self.check()
