"""`mola chat --model ... --adapter ...`: a `mola serve` of the chat's own, on
127.0.0.1 and a free port, in a process of its own session (so the Ctrl-C
that stops an answer does not reach it), stopped when the chat ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .client import ServerError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, serve_args: list[str], start_timeout: float = 600.0):
        self.serve_args = list(serve_args)
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.url: str | None = None

    def __enter__(self) -> "LocalServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        port = free_port()
        fd, log = tempfile.mkstemp(prefix="mola-chat-serve-", suffix=".log")
        self.log_path = Path(log)
        command = [sys.executable, "-m", "mola", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning", *self.serve_args]
        with os.fdopen(fd, "w") as out:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        self._wait_healthy()
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.stop()
                raise ServerError(f"mola serve exited with status {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"mola serve did not become ready in {self.start_timeout:g} s")
            time.sleep(0.2)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (mola serve drains and exits 0), then SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
