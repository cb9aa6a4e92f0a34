"""The file store's contract (adapters/batches/files.py), run against both stores: a directory, and S3.

S3 is moto's server mode (tests/s3util.py), a real HTTP S3 API on loopback,
reached through boto3 as configured by ``batches.files.s3`` (explicit keys,
the secret in a file). What every caller relies on: a file appears whole at
its commit or not at all, an input file is read line by line, a cluster's
lines file by byte ranges, a missing file is FileNotFoundError, and a store
that cannot be reached is FilesUnavailable, soon.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from extproc.adapters.batches import s3
from extproc.adapters.batches.files import DirectoryFiles, FileStore, FilesUnavailable
from extproc.adapters.batches.lines import Unusable, open_input, raw_lines
from extproc.adapters.batches.s3 import S3Files
from extproc.adapters.config.batches import S3Settings
from tests.s3util import S3Server

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def running_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_server(running_s3: S3Server) -> S3Server:
    running_s3.new_bucket()
    return running_s3


@pytest.fixture(params=["directory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FileStore]:
    if request.param == "directory":
        found: FileStore = DirectoryFiles(tmp_path / "files")
    else:
        found = S3Files.from_settings(msgspec.convert(request.getfixturevalue("s3_server").settings(), S3Settings))
    yield found
    found.close()


def read(store: FileStore, name: str) -> bytes:
    with store.open(name) as source:
        return source.read()


def test_a_file_appears_whole_at_its_commit_and_replaces_the_one_there(store: FileStore) -> None:
    writer = store.create("file-a")
    writer.write(b"first\n")
    with pytest.raises(FileNotFoundError):  # nothing under the name before the commit
        read(store, "file-a")
    assert writer.commit() == 6 and read(store, "file-a") == b"first\n"
    with store.create("file-a") as again:
        again.write(b"second, longer\n")
        again.commit()
    assert read(store, "file-a") == b"second, longer\n"


def test_an_aborted_file_leaves_nothing_and_a_block_that_raises_aborts(store: FileStore) -> None:
    writer = store.create("file-b")
    writer.write(b"x" * 100)
    writer.abort()
    with pytest.raises(RuntimeError), store.create("file-c") as cut:
        cut.write(b"y" * 100)
        raise RuntimeError("the upload was refused")
    for name in ("file-b", "file-c"):
        with pytest.raises(FileNotFoundError):
            read(store, name)


def test_a_file_larger_than_a_part_is_read_line_by_line_and_by_ranges(store: FileStore) -> None:
    line = b"%08d" % 0 + b"-" * 1015 + b"\n"  # 1 KiB lines
    count = (2 * s3.PART_BYTES + s3.PART_BYTES // 2) // len(line)  # three parts of a multipart upload
    with store.create(".batch_x.lines") as writer:
        for start in range(0, count, 1024):
            writer.write(b"".join(b"%08d" % i + line[8:] for i in range(start, min(count, start + 1024))))
        size = writer.commit()
    assert size == count * len(line)
    with store.open(".batch_x.lines") as source:
        seen = 0
        for index, raw in enumerate(raw_lines(source, 2048)):
            assert raw[:8] == b"%08d" % index and len(raw) == len(line) - 1
            seen += 1
    assert seen == count
    spans = [(0, 8), (len(line) * (count - 1), 8), (s3.PART_BYTES - 4, 8), (10, 0)]
    assert store.read_spans(".batch_x.lines", spans) == [b"00000000", b"%08d" % (count - 1),
                                                         _at(line, s3.PART_BYTES - 4, 8), b""]


def _at(line: bytes, offset: int, size: int) -> bytes:
    """The bytes the large file holds at ``offset`` (each line numbered)."""
    out = b""
    while len(out) < size:
        index, within = divmod(offset + len(out), len(line))
        out += (b"%08d" % index + line[8:])[within:within + size - len(out)]
    return out


def test_a_missing_file_is_not_found_and_a_deleted_one_is_gone(store: FileStore) -> None:
    with pytest.raises(Unusable) as missing:
        open_input(store, "file-none")
    assert missing.value.code == "missing_file"
    with store.create("file-d") as writer:
        writer.write(b"{}\n")
        writer.commit()
    store.delete("file-d")
    store.delete("file-d")  # twice: nothing happens
    with pytest.raises(FileNotFoundError):
        read(store, "file-d")


def test_a_prefix_names_the_objects(s3_server: S3Server) -> None:
    store = S3Files.from_settings(msgspec.convert(s3_server.settings(prefix="team-a/"), S3Settings))
    with store.create("file-e") as writer:
        writer.write(b"{}\n")
        writer.commit()
    store.close()
    assert s3_server.keys() == ["team-a/file-e"]


def test_credentials_come_from_the_aws_chain_when_the_file_names_none(s3_server: S3Server,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-env-secret")
    settings = {k: v for k, v in s3_server.settings().items() if k not in ("access_key_id", "secret_access_key_file")}
    store = S3Files.from_settings(msgspec.convert(settings, S3Settings))
    with store.create("file-f") as writer:
        writer.write(b"{}\n")
        writer.commit()
    assert read(store, "file-f") == b"{}\n"
    store.close()


def test_an_unreachable_store_is_unavailable_soon_for_every_call(s3_server: S3Server) -> None:
    store = S3Files.from_settings(msgspec.convert(s3_server.settings(), S3Settings))
    with store.create("file-g") as writer:
        writer.write(b"{}\n")
        writer.commit()
    s3_server.stop()
    try:
        began = time.monotonic()
        for call in (lambda: store.open("file-g"), lambda: store.read_spans("file-g", [(0, 2)]),
                     lambda: store.delete("file-g")):
            with pytest.raises(FilesUnavailable):
                call()
        cut = store.create("file-h")
        cut.write(b"{}\n")
        with pytest.raises(FilesUnavailable):
            cut.commit()
        # Refused connections, never a wait on an answer: the four calls together end before one read timeout of
        # the store's could (the bound s3.py promises per attempt), however slow the machine.
        assert time.monotonic() - began < s3.READ_TIMEOUT_S
    finally:
        s3_server.start()  # back, on the same port (the module's other tests use it): what was committed is there
    assert read(store, "file-g") == b"{}\n"
    store.close()
