"""The batch files in an S3-compatible bucket (``batches.files.s3``): AWS S3, MinIO, Ceph RGW, R2...

boto3 (the ``s3`` extra), its calls made in worker threads like every file
store's (``files.py``; docs/decisions.md says why not an async client). Each
file is one object, ``prefix + name``:

* written in parts of :data:`PART_BYTES` (a multipart upload, begun once the
  first part is full; a smaller file is one PUT), so an upload or an output
  file is never in memory whole, and the object appears only when the upload
  completes: a reader on any instance sees all of it or nothing;
* read as the response's stream (an input file, line by line) or by byte
  ranges (a cluster's lines file), never whole.

Every failure to reach the store or to have an answer from it (a refused
connection, a timeout, an error status) is :class:`FilesUnavailable` within
about :data:`CONNECT_TIMEOUT_S` and :data:`READ_TIMEOUT_S` per attempt
(botocore's standard retry mode, :data:`ATTEMPTS` attempts): the API answers
503 and the runners try again, so nothing waits on the store for long.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from extproc.adapters.batches.files import FileStore, FilesUnavailable, Writer
from extproc.adapters.config.batches import S3Settings

if TYPE_CHECKING:
    from botocore.response import StreamingBody
    from types_boto3_s3 import S3Client
    from types_boto3_s3.type_defs import CompletedPartTypeDef

# A multipart upload's part (S3's least is 5 MiB, but for the last): what a writer holds in memory at most.
PART_BYTES = 8 * 1024 * 1024
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 30.0
ATTEMPTS = 3
_MISSING = ("NoSuchKey", "404", "NotFound")

T = TypeVar("T")


class S3Files(FileStore):
    """The objects under ``prefix`` in ``bucket``."""

    def __init__(self, client: S3Client, bucket: str, prefix: str | None) -> None:
        self._client, self._bucket, self._prefix = client, bucket, prefix or ""

    @classmethod
    def from_settings(cls, settings: S3Settings) -> S3Files:
        """A client as configured: explicit keys (the secret read from its file), else the AWS credential chain."""
        secret = None
        if settings.secret_access_key_file is not None:
            secret = Path(settings.secret_access_key_file).read_text().strip()
        config = BotoConfig(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                            retries={"max_attempts": ATTEMPTS, "mode": "standard"},
                            # S3-compatible stores name the bucket in the path; AWS's own endpoint in the host.
                            s3={"addressing_style": "path" if settings.endpoint_url else "auto"})
        client = boto3.session.Session().client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region,
            aws_access_key_id=settings.access_key_id, aws_secret_access_key=secret, config=config)
        return cls(client, settings.bucket, settings.prefix)

    def key(self, name: str) -> str:
        return self._prefix + name

    def create(self, name: str) -> Writer:
        return _S3Writer(self._client, self._bucket, self.key(name))

    def open(self, name: str) -> BinaryIO:
        found = _call(lambda: self._client.get_object(Bucket=self._bucket, Key=self.key(name)), name)
        return io.BufferedReader(_Stream(found["Body"]), buffer_size=1024 * 1024)

    def read_spans(self, name: str, spans: list[tuple[int, int]]) -> list[bytes]:
        return [self._span(name, offset, size) if size else b"" for offset, size in spans]

    def _span(self, name: str, offset: int, size: int) -> bytes:
        found = _call(lambda: self._client.get_object(Bucket=self._bucket, Key=self.key(name),
                                                      Range=f"bytes={offset}-{offset + size - 1}"), name)
        return _call(found["Body"].read, name)

    def delete(self, name: str) -> None:
        _call(lambda: self._client.delete_object(Bucket=self._bucket, Key=self.key(name)), name)

    def close(self) -> None:
        self._client.close()


class _S3Writer(Writer):
    """Parts of :data:`PART_BYTES` uploaded as they fill; completed (or one PUT) by the commit."""

    def __init__(self, client: S3Client, bucket: str, key: str) -> None:
        super().__init__()
        self._client, self._bucket, self._key = client, bucket, key
        self._buffer = bytearray()
        self._upload: str | None = None
        self._parts: list[CompletedPartTypeDef] = []

    def _write(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= PART_BYTES:
            self._send(bytes(self._buffer[:PART_BYTES]))
            del self._buffer[:PART_BYTES]

    def _send(self, part: bytes) -> None:
        if self._upload is None:
            self._upload = _call(lambda: self._client.create_multipart_upload(Bucket=self._bucket, Key=self._key),
                                 self._key)["UploadId"]
        upload, number = self._upload, len(self._parts) + 1
        sent = _call(lambda: self._client.upload_part(Bucket=self._bucket, Key=self._key, UploadId=upload,
                                                      PartNumber=number, Body=part), self._key)
        self._parts.append({"PartNumber": number, "ETag": sent["ETag"]})

    def _commit(self) -> None:
        if self._upload is None:
            body = bytes(self._buffer)
            _call(lambda: self._client.put_object(Bucket=self._bucket, Key=self._key, Body=body), self._key)
            return
        if self._buffer:
            self._send(bytes(self._buffer))
        upload, parts = self._upload, self._parts
        _call(lambda: self._client.complete_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=upload,
                                                             MultipartUpload={"Parts": parts}), self._key)

    def _abort(self) -> None:
        self._buffer.clear()
        if self._upload is not None:
            upload = self._upload
            _call(lambda: self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=upload),
                  self._key)


class _Stream(io.RawIOBase):
    """A GET's body as a raw stream, so a :class:`io.BufferedReader` gives ``readline`` with a limit."""

    def __init__(self, body: StreamingBody) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = _call(lambda: self._body.read(len(buffer)), "a file being read")
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()
        super().close()


def _call(call: Callable[[], T], name: str) -> T:
    """``call``, its failures told apart: no such object (:class:`FileNotFoundError`), the store away."""
    try:
        return call()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in _MISSING:
            raise FileNotFoundError(name) from exc
        raise FilesUnavailable(f"S3: {exc}") from exc
    except BotoCoreError as exc:
        raise FilesUnavailable(f"S3: {exc}") from exc
    except OSError as exc:  # a stream cut while read (urllib3's errors are OSErrors or BotoCoreErrors)
        raise FilesUnavailable(f"S3: {exc}") from exc
