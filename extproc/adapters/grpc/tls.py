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
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from extproc.adapters.config.tls import TlsFileError, load_context

log = logging.getLogger(__name__)

# What a reload can come to (the new files serve, or the previous ones still do).
RELOAD_OUTCOMES = ("ok", "failed")


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
