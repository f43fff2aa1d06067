"""The cost model of decode steps (mola/engine/step_costs.py) against
numpy's least squares, and speculation's choice of a draft width from it
(mola/engine/speculative.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mola.engine.config import SpeculativeConfig
from mola.engine.sequence import SamplingParams, Sequence
from mola.engine.speculative import EXPLORE_CLOSE, EXPLORE_EVERY, Speculator
from mola.engine.step_costs import CLIP, TRUST_AFTER, WARM_UP, StepCosts


def test_the_fit_is_weighted_least_squares_with_an_intercept_per_kind():
    rng = np.random.default_rng(0)
    costs = StepCosts(decay=0.9)
    for _ in range(WARM_UP):  # not counted
        costs.observe(8, 1.0, True)
    obs = []
    for _ in range(40):
        spec = bool(rng.random() < 0.5)
        n = int(rng.integers(1, 9) * (rng.integers(2, 9) if spec else 1))
        t = (0.004 if spec else 0.002) + 0.0005 * n + rng.normal() * 1e-4
        costs.observe(n, t, spec)
        obs.append((n, t, spec))
    w = 0.9 ** np.arange(len(obs))[::-1]  # the latest weighs 1
    X = np.array([[1.0 - s, float(s), n] for n, _, s in obs])
    y = np.array([t for _, t, _ in obs])
    sw = np.sqrt(w)[:, None]
    (a_plain, a_spec, b), *_ = np.linalg.lstsq(X * sw, y * sw[:, 0], rcond=None)
    assert costs.slope == pytest.approx(b, rel=1e-6)
    assert costs.plain(3) == pytest.approx(a_plain + 3 * b, rel=1e-6)
    assert costs.speculative(20, 4) == pytest.approx(a_spec + 20 * b, rel=1e-6)


def test_until_speculative_steps_were_timed_extra_positions_look_free():
    costs = StepCosts()
    for n in (1, 2, 4):
        costs.observe(n, 0.01 * n, False)
    for _ in range(WARM_UP + TRUST_AFTER - 1):  # the first ones pay for new shapes; then too few
        costs.observe(40, 5.0, True)
    assert not costs.knows_speculative
    assert costs.speculative(40, 4) == pytest.approx(costs.plain(4))
    costs.observe(40, 5.0, True)
    assert costs.speculative(40, 4) > 1.0


def test_a_step_slowed_by_other_work_counts_as_clip_times_at_most():
    costs = StepCosts()
    for _ in range(10):
        costs.observe(4, 0.010, False)
    costs.observe(4, 1.0, False)  # a hundred times slower: another process had the CPU
    assert costs.plain(4) < 0.010 * (1 + CLIP) / 2 + 1e-9


def rows(n: int, rate: float, spec: Speculator) -> list[Sequence]:
    out = []
    for i in range(n):
        s = Sequence(prompt=[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], params=SamplingParams(max_tokens=100), seq_id=i)
        spec.state(s).rate = rate
        out.append(s)
    return out


def learned(fixed: float, per_position: float) -> Speculator:
    """A speculator that has timed steps costing fixed + per_position * N."""
    spec = Speculator(SpeculativeConfig(num_draft_tokens=8, max_batch=16))
    for _ in range(WARM_UP):
        spec.costs.observe(40, 1.0, True)
    for n in (1, 2, 4, 8):
        spec.costs.observe(n, fixed + per_position * n, False)
        spec.costs.observe(n * 5, fixed + per_position * n * 5, True)
    return spec


def test_the_width_with_the_most_tokens_per_second_is_chosen():
    # Positions nearly free (a GPU): the widest draft.
    spec = learned(0.010, 0.00001)
    assert spec._width(rows(4, 0.9, spec), [8] * 4) == 8
    # Positions as dear as rows (a CPU), drafts often right: a narrower one ...
    spec = learned(0.002, 0.002)
    width = spec._width(rows(4, 0.9, spec), [8] * 4)
    assert 0 < width < 8
    # ... and none when drafts are seldom right.
    assert spec._width(rows(4, 0.1, spec), [8] * 4) == 0


@pytest.mark.parametrize("rate, every", [(0.1, EXPLORE_EVERY), (0.75, EXPLORE_CLOSE)])
def test_a_turned_down_speculation_is_tried_again_now_and_then(rate, every):
    """Every EXPLORE_EVERY steps, or EXPLORE_CLOSE when it nearly paid."""
    spec = learned(0.002, 0.002)
    batch = rows(4, rate, spec)
    for s in batch:
        spec.state(s).length = 8
    assert spec._width(batch, [8] * 4) == 0
    tried = [spec.propose(batch, set()) is not None for _ in range(2 * every + 2)]
    assert tried.count(True) == 2 and tried[every]


def test_steps_are_timed_from_one_plan_to_the_next():
    spec = Speculator(SpeculativeConfig())
    spec.costs._warm_up = 0
    spec.clock(10.0, 4, None, prefill=False)
    spec.clock(10.5, 4, 5, prefill=False)  # the plain step of 4 rows took 0.5 s
    spec.clock(12.5, 4, 5, prefill=False)  # the speculative one (20 positions) took 2 s
    spec.clock(14.5, 4, 5, prefill=False)
    spec.clock(16.5, 4, None, prefill=True)
    spec.clock(30.0, 4, None, prefill=False)  # a step with a prefill chunk is not timed
    assert spec.costs.plain(4) == pytest.approx(0.5)
    assert spec.costs.speculative(20, 4) == pytest.approx(2.0)
