"""The README's operator path, followed as written: a fresh install, its config, its commands, its client call.

The README marks four fenced blocks with ``<!-- newcomer: NAME -->``: the
install, the config, the commands that run it and the OpenAI SDK call. This
test reads them out of the README and runs them, so the README cannot drift
from what works. What it changes, and only that: the addresses get free ports
(the same substitution in the config and the client, so other processes on
the machine do not collide), the engine is the simulator (``extproc-dev sim``
from the same install), the install takes the dependencies from this
environment instead of the network (``--no-deps``, this interpreter's
site-packages on the new virtualenv's path), and Envoy runs without hot
restart (several run at once on a test machine).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import sysconfig
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from extproc.adapters.config import load_config
from extproc.tools.envoy_bin import find_envoy
from extproc.tools.procs import ManagedProcess, free_port
from tests.helpers.readme import ADDRESS, readme_blocks
from tests.paths import ROOT
from tests.stackutil import metric, read_metrics

pytestmark = pytest.mark.integration

# Not part of a checkout an operator gets: virtualenvs, caches, build leftovers, benchmark output.
LEFT_OUT = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", "bench-out")


def commands(block: str) -> list[list[str]]:
    """Each line of a shell block as its words, comments dropped."""
    return [words for line in block.splitlines() if (words := shlex.split(line, comments=True))]


@pytest.fixture(scope="module")
def fresh_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout installed, as the README says, into a new virtualenv; its bin folder."""
    base = tmp_path_factory.mktemp("newcomer")
    checkout = base / "extproc"
    shutil.copytree(ROOT, checkout, ignore=LEFT_OUT)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    purelib = sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"]
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    [install] = commands(readme_blocks()["install"])
    assert install[:2] == ["pip", "install"], install
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", *install[2:]],
        cwd=checkout, capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0 and "install build dependencies" in result.stdout + result.stderr:
        pytest.skip(f"the build backend (setuptools) could not be installed, no index reachable:\n{result.stderr[-2000:]}")
    assert result.returncode == 0, result.stdout + result.stderr
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import extproc; print(extproc.__file__)"],
                           cwd=base, capture_output=True, text=True, check=True, timeout=60).stdout
    assert found.startswith(purelib), found  # the fresh install, not this checkout
    return venv / "bin"


async def test_the_readme_operator_path_works_from_a_fresh_install(fresh_install: Path, tmp_path: Path) -> None:
    blocks = readme_blocks()
    ports = {port: str(free_port()) for port in dict.fromkeys(ADDRESS.findall(blocks["config"] + blocks["client"]))}

    def local(text: str) -> str:
        return ADDRESS.sub(lambda m: f"127.0.0.1:{ports[m[1]]}", text)

    (tmp_path / "extproc.yaml").write_text(local(blocks["config"]), encoding="utf-8")
    config = load_config(tmp_path / "extproc.yaml")
    [model] = config.models
    [endpoint] = model.endpoints
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    ready = {"serve": f"http://{config.listen.metrics}/readyz", "envoy": f"http://{config.envoy.admin}/ready"}

    async with AsyncExitStack() as running:
        running.push_async_callback((await ManagedProcess.start(
            "sim", [str(fresh_install / "extproc-dev"), "sim", "--host", host, "--port", port, "--model", model.name],
            tmp_path / "sim.log", ready_url=f"{endpoint}/health",
        )).stop)
        for words in commands(blocks["run"]):
            background = words[-1] == "&"
            words = words[:-1] if background else words
            out = None
            if ">" in words:
                words, out = words[:words.index(">")], tmp_path / words[words.index(">") + 1]
            program, *args = words
            if program == "extproc":
                argv = [str(fresh_install / "extproc"), *args]
            else:
                assert program == "envoy", words
                argv = [find_envoy(), *args, "--disable-hot-restart"]
            if background:
                name = args[0] if program == "extproc" else program
                process = await ManagedProcess.start(name, argv, tmp_path / f"{name}.log", ready_url=ready[name],
                                                     timeout=60, cwd=tmp_path)
                running.push_async_callback(process.stop)
            else:
                result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
                assert result.returncode == 0, f"{words}: {result.stdout}{result.stderr}"
                if out is not None:
                    out.write_text(result.stdout, encoding="utf-8")

        client = subprocess.run([str(fresh_install / "python"), "-c", local(blocks["client"])],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert client.returncode == 0 and client.stdout.strip(), client.stdout + client.stderr
        samples = await read_metrics(f"http://{config.listen.metrics}/metrics")
        assert metric(samples, "extproc_released_total", model=model.name, tenant="alice") == 1
