"""What decode steps cost on this machine, learned as they run (plain
Python): the time of a step against the positions it computes.

A plain step computes one position per row; a speculative step 1 + D per
row, and it also waits for its own tokens (nothing is pipelined behind it).
Both are fitted by one line, seconds = intercept + slope * positions, with
an intercept of each kind and the slope shared, by least squares over the
recent steps (older ones weigh less, by DECAY per step). Speculation asks it
whether a step of so many positions pays against a plain one: on a GPU
extra positions cost next to nothing; on a CPU they may cost nearly as much
as the rows themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97  # weight an observation keeps per later one (about the last 30 steps count)


@dataclass
class _Sums:
    """Decayed sums of one kind of step's (positions, seconds)."""

    w: float = 0.0
    n: float = 0.0
    t: float = 0.0
    nn: float = 0.0
    nt: float = 0.0

    def add(self, n: float, t: float, decay: float) -> None:
        self.w = self.w * decay + 1
        self.n = self.n * decay + n
        self.t = self.t * decay + t
        self.nn = self.nn * decay + n * n
        self.nt = self.nt * decay + n * t

    def decay(self, decay: float) -> None:
        for name in ("w", "n", "t", "nn", "nt"):
            setattr(self, name, getattr(self, name) * decay)

    @property
    def spread(self) -> tuple[float, float]:
        """(sum of (n - mean n) * (t - mean t), sum of (n - mean n)^2)."""
        if self.w == 0:
            return 0.0, 0.0
        return self.nt - self.n * self.t / self.w, self.nn - self.n * self.n / self.w


class StepCosts:
    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._plain = _Sums()
        self._spec = _Sums()

    def observe(self, positions: int, seconds: float, speculative: bool) -> None:
        mine, other = (self._spec, self._plain) if speculative else (self._plain, self._spec)
        mine.add(positions, seconds, self.decay)
        other.decay(self.decay)

    @property
    def knows_plain(self) -> bool:
        return self._plain.w > 0

    @property
    def knows_speculative(self) -> bool:
        return self._spec.w > 0

    @property
    def slope(self) -> float:
        """Seconds per extra position (pooled within each kind; 0 until the
        positions have varied)."""
        cov = var = 0.0
        for s in (self._plain, self._spec):
            c, v = s.spread
            cov, var = cov + c, var + v
        return max(0.0, cov / var) if var > 1e-9 else 0.0

    def plain(self, positions: int) -> float:
        """Seconds of a plain step of this many rows."""
        s = self._plain
        return max(0.0, (s.t - self.slope * s.n) / s.w) + self.slope * positions

    def speculative(self, positions: int, rows: int) -> float:
        """Seconds of a speculative step of ``rows`` rows computing
        ``positions`` in all; before any was timed, a plain step's."""
        s = self._spec
        if s.w == 0:
            return self.plain(rows)
        return max(0.0, (s.t - self.slope * s.n) / s.w) + self.slope * positions
