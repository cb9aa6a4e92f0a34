"""``extproc serve`` with the engines' host names answered from a file instead of DNS: a headless Service's name.

A pool given by host name grows and shrinks with what the name resolves to
(``adapters/engines/discovery.py``). A real resolver cannot be pointed at
test engines without root, so the simulated autoscaler (``autoscale.py``) and
the tests run the processor through this module, which answers discovery's
lookups from a JSON file: ``{"engines.test": ["http://127.0.0.1:8001", ...]}``,
each name's members as URLs (the engines listen on 127.0.0.1, each on its own
port, where a Service's pods share one port on their own addresses). A name
listed with no member, or not listed, has no address (NXDOMAIN, as a headless
Service without a ready pod answers). The file is read at every lookup, so
rewriting it (:func:`write_hosts`, atomic) changes the pool as DNS would,
within ``models[].dns_refresh_s``.

    python -m extproc.tools.hosts HOSTS.json serve --config extproc.yaml
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from extproc.adapters.config import is_ip_address
from extproc.adapters.engines import discovery
from extproc.cli import main as extproc


def command(path: Path) -> list[str]:
    """The ``extproc`` command with host names answered from ``path`` (a stack's ``command``)."""
    return [sys.executable, "-m", "extproc.tools.hosts", str(path)]


def write_hosts(path: Path, hosts: Mapping[str, Sequence[str]]) -> None:
    """Write ``hosts`` (name -> member URLs) to ``path`` in one rename, so a lookup never reads half a file."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps({name: list(urls) for name, urls in hosts.items()}))
    os.replace(part, path)


def resolver(path: Path) -> Callable[[str], Coroutine[None, None, list[str]]]:
    """Discovery's ``resolve`` answered from the file at ``path`` (an address stands for itself, as with DNS)."""

    async def resolve(endpoint: str) -> list[str]:
        host = urlsplit(endpoint).hostname or ""
        if is_ip_address(host):
            return [endpoint]
        members: list[str] = json.loads(path.read_text()).get(host, [])
        if not members:
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: no member in {path}")
        return sorted(members)

    return resolve


def main(argv: list[str] | None = None) -> int:
    """``HOSTS.json`` then the ``extproc`` command line."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    # The one name discovery looks its members up by, replaced before the processor starts (a fake of DNS).
    discovery.resolve = resolver(Path(args[0]))  # type: ignore[assignment]
    return extproc(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
