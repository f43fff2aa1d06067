"""A long conversion's progress: on a terminal a bar redrawn in place (tensors and
bytes done, time left), elsewhere a log line every few seconds. Nothing shows for a
conversion that ends within ``after_s``. Time is an argument: each call takes ``now``
(time.monotonic's seconds) so that tests pass their own."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

log = logging.getLogger("mola.loader")

BAR_WIDTH = 24


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


@dataclass
class Progress:
    label: str  # what converts, e.g. the file's name
    total_tensors: int
    total_bytes: int  # the file's tensor bytes
    start: float  # time.monotonic() at the start
    stream: object = None  # a terminal gets the bar; None: sys.stderr
    after_s: float = 3.0  # shown once a conversion has run this long
    every_s: float = 5.0  # seconds between log lines (no terminal)
    redraw_s: float = 0.25  # seconds between redraws of the bar
    tensors: int = 0
    done_bytes: int = 0
    _last: float = field(default=float("-inf"), repr=False)
    _drawn: bool = field(default=False, repr=False)

    @property
    def is_terminal(self) -> bool:
        stream = self.stream or sys.stderr
        return bool(getattr(stream, "isatty", lambda: False)())

    def line(self, now: float) -> str:
        """``model.gguf: [#####-----] 120/218 tensors, 512/1,007 MiB, 4 s left``."""
        frac = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        elapsed = now - self.start
        left = f"{elapsed * (1 - frac) / frac:.0f} s left" if frac > 0 else "time left unknown"
        filled = int(BAR_WIDTH * frac)
        return (f"converting {self.label}: [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {self.tensors}/"
                f"{self.total_tensors} tensors, {_mib(self.done_bytes)}/{_mib(self.total_bytes)}, {left}")

    def advance(self, nbytes: int, now: float) -> None:
        """One more tensor of ``nbytes`` file bytes done at ``now``."""
        self.tensors += 1
        self.done_bytes += nbytes
        if now - self.start < self.after_s:
            return
        terminal = self.is_terminal
        if now - self._last < (self.redraw_s if terminal else self.every_s):
            return
        self._last = now
        if terminal:
            stream = self.stream or sys.stderr
            stream.write(f"\r[mola] {self.line(now)}\x1b[K")
            stream.flush()
            self._drawn = True
        else:
            log.info("%s", self.line(now))

    def close(self, now: float) -> None:
        """End the bar's line (the last state drawn in full)."""
        if self._drawn:
            stream = self.stream or sys.stderr
            stream.write(f"\r[mola] {self.line(now)}\n")
            stream.flush()
            self._drawn = False
