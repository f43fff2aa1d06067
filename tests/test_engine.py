"""The engine thread on a real tiny mlx-lm model: seeded sampling in a batch,
aborts, stop tokens and the snapshot it publishes (mola/engine/engine.py;
the forward pass itself is tests/test_runner.py)."""

from __future__ import annotations

import pytest

from helpers.engines import ENGINE_QUESTIONS as QUESTIONS
from helpers.engines import ENGINE_MAX_TOKENS as MAX_TOKENS
from helpers.references import greedy_tokens, merged_model
from helpers.servers import wait_until


@pytest.fixture(scope="module")
def base_reference(tiny_model, runner):
    """Greedy tokens of plain mlx-lm on the bare base for QUESTIONS[1]."""
    model, _ = merged_model(tiny_model, [])
    return greedy_tokens(model, runner.prompt(QUESTIONS[1]), MAX_TOKENS)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(runner):
    prompt = runner.prompt(QUESTIONS[0])
    params = dict(temperature=0.9, top_p=0.95, seed=42, max_tokens=12)
    alone = runner.run(prompt, "a", **params)
    others = [runner.submit(runner.prompt(q), n, temperature=1.0) for q in QUESTIONS for n in (None, "c")]
    mine = runner.submit(prompt, "a", **params)
    runner.wait([*others, mine])
    assert mine.output == alone
    assert runner.run(prompt, "a", **{**params, "seed": 43}) != alone


def test_abort_finishes_the_sequence_and_frees_its_row(runner):
    long = runner.submit(runner.prompt(QUESTIONS[1]), "a", max_tokens=1000)
    short = runner.submit(runner.prompt(QUESTIONS[0]), "b", max_tokens=5)
    runner.wait_decoding([long])
    runner.engine.abort(long.seq_id)
    runner.wait([long, short])
    assert long.finish_reason == "abort" and len(long.output) < 1000
    assert short.finish_reason == "length" and len(short.output) == 5
    assert runner.engine.call(lambda: runner.engine.runner.num_rows == 0 or not runner.engine.scheduler.running).result()


def test_stop_tokens_finish_with_stop(runner, base_reference):
    ref = base_reference
    seq = runner.submit(runner.prompt(QUESTIONS[1]), None, stop_token_ids=frozenset({ref[3]}))
    runner.wait([seq])
    first = ref.index(ref[3])
    assert seq.output == ref[: first + 1] and seq.finish_reason == "stop"


def test_the_engine_numbers_its_sequences_and_reports_by_number(runner):
    """Engine.add numbers each sequence (the engine's own counter); its
    outputs carry that number and what the loop needs, never the Sequence."""
    seen = []
    prev = runner.engine.on_outputs

    def keep(outputs):
        seen.extend(outputs)
        prev(outputs)

    runner.engine.on_outputs = keep
    try:
        a = runner.submit(runner.prompt(QUESTIONS[0]), None, max_tokens=3)
        b = runner.submit(runner.prompt(QUESTIONS[2]), "a", max_tokens=3)
        runner.wait([a, b])
    finally:
        runner.engine.on_outputs = prev
    assert b.seq_id == a.seq_id + 1
    for seq in (a, b):
        mine = [o for o in seen if o.seq_id == seq.seq_id]
        assert [t for o in mine for t in o.tokens] == seq.output
        assert [o.finish_reason for o in mine][-1] == seq.finish_reason == "length"
        assert all(not hasattr(o, "seq") for o in mine)
    with pytest.raises(AssertionError):
        runner.engine.add(a)  # a sequence is added once


def test_the_engine_publishes_an_immutable_snapshot(runner):
    """Other threads read the engine's state from a snapshot the engine thread
    replaces after each step, never from the scheduler or runner."""
    import dataclasses

    before = runner.engine.snapshot
    runner.run(runner.prompt(QUESTIONS[0]), max_tokens=4)
    after = runner.engine.snapshot
    assert after.num_steps > before.num_steps
    assert after.stats.decode_steps >= before.stats.decode_steps + 3
    # the finished row leaves the batch at the next step, and the snapshot after it says so
    wait_until(lambda: runner.engine.snapshot.num_running == 0, 10, "an idle snapshot")
    idle = runner.engine.snapshot
    assert idle.num_running == idle.num_waiting == idle.num_prefilling == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.num_steps = 0
    runner.run(runner.prompt(QUESTIONS[2]), max_tokens=3)
    assert runner.engine.snapshot.stats.decode_steps > after.stats.decode_steps  # a copy, not a view
