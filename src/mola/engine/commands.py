"""What other threads hand the engine thread: functions it runs, in order,
between two steps (add a sequence, abort one, write a slot, any call)."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any, Callable

from ..errors import EngineUnavailable


class Commands:
    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, command: Callable[[], Any]) -> None:
        """Any thread: queue ``command``."""
        self._queue.put(command)

    def call(self, fn: Callable[[], Any], is_down: Callable[[], bool]) -> Future:
        """Any thread: a Future of ``fn()``, run on the engine thread; it
        fails with EngineUnavailable if by then the engine is down (``is_down()``)."""
        future: Future = Future()

        def run():
            if not future.set_running_or_notify_cancel():
                return
            if is_down():
                future.set_exception(EngineUnavailable("The engine has stopped."))
                return
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self.put(run)
        return future

    def run(self, wait: bool = False, timeout: float | None = None) -> bool:
        """The engine thread: run the commands queued. With ``wait``, first
        wait up to ``timeout`` seconds (None: for ever) for one; returns
        False when that wait ran out."""
        if wait:
            try:
                self._queue.get(timeout=timeout)()
            except queue.Empty:
                return False
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return True
            command()
