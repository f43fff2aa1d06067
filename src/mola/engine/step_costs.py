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

A machine shared with other work makes some steps far slower than others:
once a kind of step has been timed a few times, a time further than CLIP
times from what the fit expects counts as that far only. The first
speculative steps, which pay for new array shapes, are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97  # weight an observation keeps per later one (about the last 30 steps count)
WARM_UP = 2  # speculative steps not counted (new array shapes)
TRUST_AFTER = 3  # counted steps of a kind before their fit is believed (and clips)
CLIP = 2.0  # a time counts as at most this many times, or this fraction of, the fit's


@dataclass
class _Sums:
    """Decayed sums of one kind of step's (positions, seconds)."""

    w: float = 0.0
    n: float = 0.0
    t: float = 0.0
    nn: float = 0.0
    nt: float = 0.0
    count: int = 0  # observations counted, undecayed

    def add(self, n: float, t: float, decay: float) -> None:
        self.w = self.w * decay + 1
        self.n = self.n * decay + n
        self.t = self.t * decay + t
        self.nn = self.nn * decay + n * n
        self.nt = self.nt * decay + n * t
        self.count += 1

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
        self._warm_up = WARM_UP

    def observe(self, positions: int, seconds: float, speculative: bool) -> None:
        if speculative and self._warm_up > 0:
            self._warm_up -= 1
            return
        mine, other = (self._spec, self._plain) if speculative else (self._plain, self._spec)
        if mine.count >= TRUST_AFTER:
            expected = self._line(mine, positions)
            if expected > 0:
                seconds = min(max(seconds, expected / CLIP), expected * CLIP)
        mine.add(positions, seconds, self.decay)
        other.decay(self.decay)

    @property
    def knows_plain(self) -> bool:
        return self._plain.count > 0

    @property
    def knows_speculative(self) -> bool:
        """Enough speculative steps were timed to believe their fit."""
        return self._spec.count >= TRUST_AFTER

    @property
    def slope(self) -> float:
        """Seconds per extra position (pooled within each kind; 0 until the
        positions have varied)."""
        cov = var = 0.0
        for s in (self._plain, self._spec):
            c, v = s.spread
            cov, var = cov + c, var + v
        return max(0.0, cov / var) if var > 1e-9 else 0.0

    def _line(self, s: _Sums, positions: int) -> float:
        return max(0.0, (s.t - self.slope * s.n) / s.w) + self.slope * positions

    def plain(self, positions: int) -> float:
        """Seconds of a plain step of this many rows."""
        return self._line(self._plain, positions)

    def speculative(self, positions: int, rows: int) -> float:
        """Seconds of a speculative step of ``rows`` rows computing
        ``positions`` in all; until a few were timed, a plain step's."""
        if not self.knows_speculative:
            return self.plain(rows)
        return self._line(self._spec, positions)
