"""A real server in a thread (start_server), `mola serve` in a process of its own, and waiting on them."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
import httpx
import uvicorn
from mola.config import ServeConfig
from mola.engine.engine import Engine
from mola.server.app import create_app
from mola.bases.control import Bases
from mola.server.metrics import Metrics
from mola.server.startup import start_base


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound_socket() -> socket.socket:
    """A socket bound to 127.0.0.1 at a free port, for uvicorn's ``serve(sockets=...)``:
    held from now on, so that no other process takes the port before the server listens.
    Made with IPPROTO_TCP, as getaddrinfo makes uvicorn's own: asyncio sets TCP_NODELAY
    on the connections it accepts only then (without it, Nagle's algorithm and delayed
    ACKs add about 40 ms to each small response)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class ServerHandle:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    config: ServeConfig

    @property
    def app(self):
        return self.server.config.app

    @property
    def state(self):
        return self.app.state.bases.default.state

    @property
    def engine(self) -> Engine:
        """The default base's engine (its thread, its published snapshot)."""
        return self.state.engine.engine

    def stop(self) -> None:
        """Stop uvicorn: the app's close stops every base (Bases.close)."""
        self.server.should_exit = True
        self.thread.join(timeout=30)


class _Server(uvicorn.Server):
    """uvicorn's server, setting ``ready`` once it listens (or failed to)."""

    def __init__(self, config: uvicorn.Config, ready: threading.Event):
        super().__init__(config)
        self.ready = ready

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


def start_server(**kwargs) -> ServerHandle:
    """`mola serve`'s start path (its bases, each started by start_base) and
    uvicorn on 127.0.0.1, in this process; the event loop runs on a thread of
    its own. The port is bound before the model loads and handed to uvicorn
    as a socket, so no other process can take it meanwhile."""
    sock = bound_socket()
    config = ServeConfig.from_settings(host="127.0.0.1", port=sock.getsockname()[1], log_level="warning", **kwargs)
    box: dict = {}
    ready = threading.Event()  # uvicorn listens, or the loop ended before it could

    async def main():
        bases = Bases.declared(config, Metrics(), start_base)
        try:
            await bases.preload()
            app = create_app(bases.default.state, bases)
            box["server"] = server = _Server(uvicorn.Config(app, host=config.http.host, port=config.http.port,
                                                            log_level="warning"), ready)
            await server.serve(sockets=[sock])
        finally:
            sock.close()
            await bases.close()

    def run():
        try:
            asyncio.run(main())
        except BaseException as e:  # reported below
            box["error"] = e
        finally:
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(timeout=600)  # the model loads first
    if not ("server" in box and box["server"].started):
        raise RuntimeError(f"the test server did not start: {box.get('error')}")
    return ServerHandle(f"http://127.0.0.1:{config.http.port}", box["server"], thread, config)


def start_mola_serve(args, env=None, timeout=120):
    """`mola serve ARGS` in a process of its own on 127.0.0.1, once /health answers 200."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mola", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout, proc.kill)
    return proc, url


def wait_healthy(proc, url: str, timeout: float, kill) -> None:
    """Wait until ``url``/health answers 200; fail with the process's output
    if it exits first, and ``kill`` it after ``timeout`` seconds."""
    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"mola serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        return status_is(url + "/health", 200)

    try:
        wait_until(healthy, timeout, "mola serve to become healthy", every=0.2)
    except TimeoutError:
        kill()
        raise AssertionError("mola serve did not become healthy") from None


def status_is(url: str, status: int) -> bool:
    """Whether GET ``url`` answers ``status`` now (False when nothing listens yet)."""
    try:
        return httpx.get(url, timeout=1).status_code == status
    except httpx.HTTPError:
        return False


def wait_until(predicate, timeout: float = 10.0, what: str = "the condition", every: float = 0.01):
    """Poll ``predicate()`` until it holds (returns its value); TimeoutError
    after ``timeout`` seconds. For states that nothing signals to a test:
    another process (a server's /health), the snapshot the engine thread
    republishes after each step, counters the server's event loop keeps.
    Where an event exists (a callback, a stream's next line, a Condition),
    wait on it instead."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(every)
    return value


async def settle(predicate, timeout: float = 10.0, every: float = 0.002):
    """wait_until on an event loop: poll ``predicate()`` (a coroutine
    function too) between the loop's other work until it holds, for states
    that no future signals (a prefetch done, a request in line, a slot
    cleared by a spawned task, a server's counters)."""
    async def holds() -> bool:
        value = predicate()
        return await value if inspect.isawaitable(value) else value

    async def poll():
        while not await holds():
            await asyncio.sleep(every)
    await asyncio.wait_for(poll(), timeout)


def stop_mola_serve(proc) -> tuple[int, str]:
    """SIGINT, as Ctrl-C; the exit status and everything it printed."""
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out
