"""TLS on the gRPC port (adapters/grpc/tls.py): its settings, the handshake grpcio's client makes, mutual TLS, and reloads.

grpcio is an independent TLS + HTTP/2 client (it insists on ALPN h2, as
Envoy's gateways do); the certificates come from tests/tlsutil.py, made per
test. Rotation runs on both event loops: ``serve`` runs on uvloop, whose TLS
is its own implementation.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.config import ConfigError, parse_config
from extproc.adapters.grpc.health import Health
from extproc.adapters.grpc.tls import ServerTls
from extproc.adapters.grpc.transport import Transport, TransportLimits
from extproc.adapters.server import ProcessorServer
from extproc.adapters.transports import TRANSPORTS
from extproc.tools.procs import free_port
from tests.stackutil import metric, read_metrics
from tests.tlsutil import CA, Pair, SecretVolume, common_name

pytestmark = pytest.mark.unit

MODEL = {"name": "m", "endpoints": ["http://127.0.0.1:1"]}
SERVING = health_pb2.HealthCheckResponse.SERVING
T = TypeVar("T")


def config_errors(tls: dict[str, Any], **top: Any) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as error:
        parse_config({"models": [MODEL], "listen": {"tls": tls}, **top})
    return error.value.errors


def test_tls_settings_are_checked_at_load_each_error_with_its_key_path(tmp_path: Path) -> None:
    ca = CA(tmp_path)
    one, two = ca.issue("one"), ca.issue("two")
    assert config_errors({"cert_file": str(one.cert)}) == ("listen.tls.key_file: is required",)
    assert config_errors({"cert_file": str(tmp_path / "gone.crt"), "key_file": str(one.key)}) == (
        f"listen.tls.cert_file: file not found: {tmp_path / 'gone.crt'}",)
    assert config_errors({"cert_file": str(one.key), "key_file": str(one.key)})[0].startswith(
        f"listen.tls.cert_file: not a PEM certificate: {one.key}")
    assert config_errors({"cert_file": str(one.cert), "key_file": str(two.key)})[0].startswith(
        f"listen.tls.key_file: does not match cert_file: {two.key}")
    assert config_errors({"cert_file": str(one.cert), "key_file": str(one.cert)})[0].startswith(
        "listen.tls.key_file: not a PEM private key")
    assert config_errors({"cert_file": str(one.cert), "key_file": str(one.key), "client_ca_file": str(tmp_path),
                          "reload_s": 0}) == (
        "listen.tls.reload_s: must be a number > 0, got 0",)
    assert config_errors({"cert_file": str(one.cert), "key_file": str(one.key), "client_ca_file": str(tmp_path)}) == (
        f"listen.tls.client_ca_file: file not found: {tmp_path}",)
    # Envoy's side of TLS: only with a TLS port, and a client certificate with its key.
    with pytest.raises(ConfigError) as error:
        parse_config({"models": [MODEL], "envoy": {"processor_ca_file": "/ca.crt", "processor_client_key_file": "/k"}})
    assert error.value.errors == (
        "envoy.processor_client_cert_file: is required with processor_client_key_file",
        "envoy.processor_ca_file: needs listen.tls (the processor's gRPC port is plaintext without it)",
        "envoy.processor_client_key_file: needs listen.tls (the processor's gRPC port is plaintext without it)",
    )
    good = parse_config({"models": [MODEL], "listen": {"tls": {"cert_file": str(one.cert), "key_file": str(one.key)}}})
    assert good.listen.tls is not None and good.listen.tls.reload_s == 5.0 and good.listen.tls.client_ca_file is None
    # Every instance of a cluster (or shard) serves the file's TLS on its own address.
    instances = {"a": {"grpc": "127.0.0.1:50061", "metrics": "127.0.0.1:9465"}}
    clustered = parse_config({"models": [MODEL], "listen": {"tls": {"cert_file": str(one.cert), "key_file": str(one.key)}},
                              "cluster": {"redis_url": "redis://127.0.0.1:6379", "instances": instances}})
    assert clustered.for_instance("a").listen.tls == good.listen.tls
    assert clustered.for_instance("a").listen.grpc == "127.0.0.1:50061"


def _tls(ca: CA, server: Pair, *, mutual: bool = False, reload_s: float = 5.0) -> Any:
    tls: dict[str, Any] = {"cert_file": str(server.cert), "key_file": str(server.key), "reload_s": reload_s}
    if mutual:
        tls["client_ca_file"] = str(ca.cert_file)
    config = parse_config({"models": [MODEL], "listen": {"tls": tls}})
    assert config.listen.tls is not None
    return config.listen.tls


async def _serving(tls: ServerTls, transport: str) -> tuple[Transport, int]:
    """Health over TLS on either transport (listen.transport), both given the same ServerTls."""
    health = Health(lambda: True)
    health.start()
    port = free_port()
    server = TRANSPORTS[transport](health.methods(), TransportLimits())
    await server.start("127.0.0.1", port, tls)
    return server, port


EACH_TRANSPORT = pytest.mark.parametrize("transport", list(TRANSPORTS))


def _credentials(ca: CA, client: Pair | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.cert_file.read_bytes(),
        private_key=None if client is None else client.key.read_bytes(),
        certificate_chain=None if client is None else client.cert.read_bytes(),
    )


async def _check(target: str, credentials: grpc.ChannelCredentials | None) -> Any:
    """One health Check on a fresh channel: the status, or the failed call's code."""
    channel: Any = (grpc.aio.insecure_channel(target) if credentials is None
                    else grpc.aio.secure_channel(target, credentials))
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()


@EACH_TRANSPORT
async def test_grpcio_checks_health_over_tls_and_a_plaintext_client_is_refused(tmp_path: Path, transport: str) -> None:
    ca = CA(tmp_path)
    server, port = await _serving(ServerTls(_tls(ca, ca.issue("server"))), transport)
    try:
        for host in ("127.0.0.1", "localhost"):  # without SNI (an IP address) and with it
            assert await _check(f"{host}:{port}", _credentials(ca)) == SERVING
        assert await _check(f"127.0.0.1:{port}", None) == grpc.StatusCode.UNAVAILABLE
        other = CA(tmp_path / "other", "another CA")
        assert await _check(f"127.0.0.1:{port}", _credentials(other)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


@EACH_TRANSPORT
async def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_client_ca(tmp_path: Path, transport: str) -> None:
    ca = CA(tmp_path)
    server, port = await _serving(ServerTls(_tls(ca, ca.issue("server"), mutual=True)), transport)
    target = f"127.0.0.1:{port}"
    try:
        assert await _check(target, _credentials(ca, ca.issue("client", server=False))) == SERVING
        assert await _check(target, _credentials(ca)) == grpc.StatusCode.UNAVAILABLE
        stranger = CA(tmp_path / "other", "another CA").issue("stranger", server=False)
        assert await _check(target, _credentials(ca, stranger)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def _served_cn(port: int, ca: CA, client: Pair | None = None) -> str:
    """The common name of the certificate a new TLS connection is shown (ALPN h2 agreed)."""
    context = ssl.create_default_context(cafile=ca.cert_file)
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        connection = writer.get_extra_info("ssl_object")
        assert connection.selected_alpn_protocol() == "h2"
        return common_name(connection.getpeercert(binary_form=True))
    finally:
        writer.close()


async def _eventually(read: Callable[[], Awaitable[T]], expected: T, timeout_s: float = 5.0) -> T:
    """``read()`` every 20 ms until it gives ``expected`` or the timeout; the last value, for the assertion."""
    value = await read()
    for _ in range(int(timeout_s / 0.02)):
        if value == expected:
            break
        await asyncio.sleep(0.02)
        value = await read()
    return value


async def _rotation(tmp_path: Path, transport: str) -> None:
    ca = CA(tmp_path / "ca")
    client = ca.issue("client", server=False)
    volume = SecretVolume(tmp_path / "secret")
    first, second, third = (ca.issue(name) for name in ("server-1", "server-2", "server-3"))

    def mount(pair: Pair, key: Pair | None = None) -> None:
        volume.write({"tls.crt": pair.cert.read_bytes(), "tls.key": (key or pair).key.read_bytes(),
                      "ca.crt": ca.cert_file.read_bytes()})

    mount(first)
    settings = parse_config({"models": [MODEL], "listen": {"tls": {
        "cert_file": str(volume.path("tls.crt")), "key_file": str(volume.path("tls.key")),
        "client_ca_file": str(volume.path("ca.crt")), "reload_s": 0.05}}}).listen.tls
    assert settings is not None
    outcomes: list[str] = []
    tls = ServerTls(settings, outcomes.append)
    server, port = await _serving(tls, transport)
    watch = asyncio.create_task(tls.watch())
    # A connection opened before the rotation (grpcio's blocking client, on its own threads: any loop).
    held = grpc.secure_channel(f"127.0.0.1:{port}", _credentials(ca, client))
    stub = health_pb2_grpc.HealthStub(held)
    loop = asyncio.get_running_loop()

    async def check_held() -> Any:
        return (await loop.run_in_executor(None, lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5))).status

    try:
        assert await _served_cn(port, ca, client) == "server-1"
        assert await check_held() == SERVING
        mount(second)
        assert await _eventually(lambda: _served_cn(port, ca, client), "server-2") == "server-2"
        assert outcomes == ["ok"]
        assert await check_held() == SERVING  # the old connection kept its session
        # A half-written pair (the new certificate, the old key): the last good one keeps serving.
        mount(third, key=second)
        assert await _eventually(lambda: _now(len(outcomes)), 2) == 2
        assert outcomes == ["ok", "failed"]
        assert await _served_cn(port, ca, client) == "server-2"
        mount(third)  # the rest of it arrives: retried
        assert await _eventually(lambda: _served_cn(port, ca, client), "server-3") == "server-3"
        assert outcomes == ["ok", "failed", "ok"]
    finally:
        held.close()
        watch.cancel()
        await server.stop(0)


async def _now(value: T) -> T:
    return value


@EACH_TRANSPORT
@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_changed_files_serve_new_connections_without_a_restart_and_a_broken_pair_keeps_the_old(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop], transport: str
) -> None:
    """A Secret volume's symlink swap: new handshakes get the new certificate once reload_s has passed."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_rotation(tmp_path, transport))


async def test_serve_listens_with_tls_and_counts_reloads(tmp_path: Path) -> None:
    ca = CA(tmp_path)
    server_pair = ca.issue("server")
    config = parse_config({"models": [MODEL], "listen": {
        "grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}",
        "tls": {"cert_file": str(server_pair.cert), "key_file": str(server_pair.key), "reload_s": 0.05}}})
    server = ProcessorServer(config)
    await server.start()
    try:
        assert await _check(config.listen.grpc, _credentials(ca)) == SERVING
        url = f"http://{config.listen.metrics}/metrics"  # the metrics port stays plain HTTP
        assert metric(await read_metrics(url), "extproc_tls_reloads_total", outcome="ok") == 0
        server_pair.key.write_bytes(ca.issue("server-2").key.read_bytes())  # a key without its certificate
        assert await _eventually(lambda: _reloads(url, "failed"), 1.0) == 1.0
        assert await _check(config.listen.grpc, _credentials(ca)) == SERVING
    finally:
        await server.close()


async def _reloads(url: str, outcome: str) -> float:
    return metric(await read_metrics(url), "extproc_tls_reloads_total", outcome=outcome)
