"""A real `edgemoe serve` process on the demo model, started once per session, on 127.0.0.1 only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MODEL = "edgemoe-demo"
MAX_RUNNING, MAX_QUEUE, MAX_BODY = 4, 4, 100_000  # small limits so that 429 and 413 are cheap to reach


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m edgemoe serve` in a subprocess; its output goes to files (a full pipe would block it)."""

    def __init__(self, folder: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = folder / "stdout.txt", folder / "stderr.txt"
        cmd = [sys.executable, "-m", "edgemoe", "serve", "--port", str(self.port), *flags]
        # one torch thread: the server shares 2 CI cores with this test process, and an OpenMP team that
        # oversubscribes them spins at its barriers (seen: 5 ms decode steps turning into 1 s)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        self.health_seen: list[httpx.Response] = []

    def wait_ready(self, timeout: float = 300) -> None:  # generous: a busy machine imports and loads slowly
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.err.read_text()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                self.health_seen.append(r)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s: {self.err.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    proc = ServerProcess(
        tmp_path_factory.mktemp("server"),
        *("--max-num-seqs", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE), "--max-body-bytes", str(MAX_BODY)),
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="session")
def tool_server(tmp_path_factory):
    """The serve app in this process on the demo model dressed as a Qwen3-style tool-calling model (its template and
    think/tool tokens); tests script its output with `tool_server.script.push(text)` (benchmarks/scripted_server.py)."""
    import torch

    from benchmarks.scripted_server import QWEN3_TEMPLATE, QWEN_TOKENS, InProcessServer, make_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine thread shares 2 CI cores with the clients and the other server
    server = InProcessServer(make_model(tmp_path_factory.mktemp("agents") / "qwen-tools", QWEN3_TEMPLATE, QWEN_TOKENS))
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(threads)
