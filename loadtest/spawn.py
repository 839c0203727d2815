"""Start a server as a child process on a free loopback port, wait until it answers,
and stop it again (SIGTERM, then SIGKILL) — only the process this module started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import IO

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kvserve_cmd(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--no-request-log", *extra]


def transformers_cmd(model: str, port: int, continuous_batching: bool = False,
                     dtype: str = "float32", *extra: str) -> list[str]:
    """`transformers serve` pinned to one local model directory, on the CPU."""
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    cb = ["--continuous-batching"] if continuous_batching else []
    return [exe, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--dtype", dtype, "--log-level", "warning", *cb, *extra]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment plus `env`, offline, with this checkout first on the path: what
    every child kvserve of a benchmark starts with (a server, or the offline reference
    of loadtest/offline_ref.py), so the two differ in nothing but what they are told."""
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    out["PYTHONPATH"] = python_path()
    return out


def python_path() -> str:
    """This checkout first, then whatever PYTHONPATH already holds (packages installed
    with `pip --target`, as on a lent GPU machine: a child that lost them could not
    import uvicorn)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))


class Spawned:
    """A server child process. `ready_path` is polled until it answers 200."""

    def __init__(self, cmd: list[str], port: int, log_path: str | None = None,
                 ready_path: str = "/health", env: dict[str, str] | None = None) -> None:
        """The child gets this environment as it is plus `env`: no thread settings behind
        the caller's back (kvserve takes `--cpu-threads`; a peer's own knobs go in `env`)."""
        self.cmd, self.port, self.ready_path = cmd, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.env = child_env(env)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log: IO | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 300.0) -> Spawned:
        if self.proc is not None:
            raise RuntimeError("already started")
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        out = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=out,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.cmd[:3]} exited with {self.proc.returncode} "
                                       f"before answering (log: {self.log_path})")
                try:
                    if c.get(self.url + self.ready_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.cmd[:3]} did not answer {self.ready_path} "
                                       f"within {timeout:.0f}s (log: {self.log_path})")
                time.sleep(0.25)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (kvserve drains), then SIGKILL; returns the exit code."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self._log:
            self._log.close()
            self._log = None
        return p.returncode

    def __enter__(self) -> Spawned:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
