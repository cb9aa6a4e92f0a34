"""An S3-compatible store for the tests: moto's server mode, a real HTTP S3 API on a loopback port.

It runs in the test's own process (a thread); ``extproc serve`` children reach
it over HTTP like any S3-compatible store. :meth:`S3Server.stop` and
:meth:`S3Server.start` take it away and bring it back on the same port with
its objects kept (moto keeps them in the process), as an outage would.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3

from extproc.tools.procs import free_port

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer

ACCESS_KEY_ID = "test-key-id"
SECRET_ACCESS_KEY = "test-secret"


class S3Server:
    def __init__(self, secrets_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bucket = f"batches-{secrets.token_hex(4)}"  # moto's objects are the process's: one bucket per test
        self.secret_file = secrets_dir / "s3-secret"
        self.secret_file.write_text(SECRET_ACCESS_KEY + "\n")
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        # Imported here, not with the module: every test worker collects this module, few start a server.
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def create_bucket(self) -> None:
        self.client().create_bucket(Bucket=self.bucket)

    def new_bucket(self) -> None:
        """A bucket of the next test's own on the same server: a server started once serves a module's tests."""
        self.bucket = f"batches-{secrets.token_hex(4)}"
        self.create_bucket()

    def client(self) -> Any:
        return boto3.session.Session().client("s3", endpoint_url=self.url, region_name="us-east-1",
                                              aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY)

    def keys(self) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=self.bucket)
        return sorted(item["Key"] for item in listed.get("Contents", []))

    def settings(self, prefix: str | None = "batches/") -> dict[str, Any]:
        """``batches.files.s3`` for this store, with explicit keys (the secret in its file)."""
        return {"bucket": self.bucket, "endpoint_url": self.url, "region": "us-east-1", "access_key_id": ACCESS_KEY_ID,
                "secret_access_key_file": str(self.secret_file), **({"prefix": prefix} if prefix else {})}
