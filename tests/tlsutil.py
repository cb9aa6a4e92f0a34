"""Test certificates, made at test time (none are committed): a CA, server certificates and a client certificate.

Server certificates name ``127.0.0.1`` and ``localhost``; each has its own
common name and a random serial, so a test can tell which one a handshake got.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAMES = ("localhost",)
SERVER_IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return Pair(cert_path, key_path)


class CA:
    """A certificate authority in ``directory``: ``ca.crt`` / ``ca.key``; it issues the other certificates."""

    def __init__(self, directory: Path, name: str = "extproc test CA") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._key = _key()
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.pair = _write(directory / "ca", self.cert, self._key)

    @property
    def cert_file(self) -> Path:
        return self.pair.cert

    def issue(self, name: str, *, server: bool = True) -> Pair:
        """A certificate with common name ``name`` (files ``name.crt``, ``name.key``): a server's or a client's."""
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        )
        if server:
            names: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVER_NAMES]
            names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVER_IPS]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return _write(self.directory / name, builder.sign(self._key, hashes.SHA256()), key)


def common_name(pem_or_der: bytes) -> str:
    """The common name of a certificate, PEM or DER."""
    cert = (x509.load_pem_x509_certificate(pem_or_der) if pem_or_der.lstrip().startswith(b"-----")
            else x509.load_der_x509_certificate(pem_or_der))
    value = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    return value if isinstance(value, str) else value.decode()


class SecretVolume:
    """Files laid out as a Kubernetes Secret volume: ``tls.crt`` -> ``..data/tls.crt``, ``..data`` -> a dated directory.

    :meth:`write` replaces every file at once, as the kubelet does: a new
    directory, then an atomic rename of the ``..data`` symlink onto it.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._version = 0

    def path(self, name: str) -> Path:
        return self.directory / name

    def write(self, files: dict[str, bytes]) -> None:
        self._version += 1
        target = self.directory / f"..v{self._version}"
        target.mkdir()
        for name, content in files.items():
            (target / name).write_bytes(content)
            link = self.directory / name
            if not link.is_symlink():
                link.symlink_to(Path("..data") / name)
        staged = self.directory / "..data_tmp"
        staged.symlink_to(target.name)
        staged.replace(self.directory / "..data")


def processor_tls(directory: Path, *, mutual: bool = True, reload_s: float = 5.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Certificates in ``directory`` for TLS between Envoy and the processor: (``listen.tls``, the ``envoy`` keys).

    The processor's certificate (``processor``) and Envoy's client one
    (``envoy``) come from one CA; ``mutual`` makes the processor ask for it.
    """
    ca = CA(directory)
    server, client = ca.issue("processor"), ca.issue("envoy", server=False)
    tls: dict[str, Any] = {"cert_file": str(server.cert), "key_file": str(server.key), "reload_s": reload_s}
    envoy = {"processor_ca_file": str(ca.cert_file)}
    if mutual:
        tls["client_ca_file"] = str(ca.cert_file)
        envoy |= {"processor_client_cert_file": str(client.cert), "processor_client_key_file": str(client.key)}
    return tls, envoy
