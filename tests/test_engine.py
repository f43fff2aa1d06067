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


# ---- slot packs sized to what is loaded, resized under traffic ---------------------

LONG_TOKENS = 48


def _resize_schedule(tiny_model, adapters, at_ceilings: bool, compact_idle_s: float = 0.0):
    """Two long rows (on adapter a, rank 4 on q/v, and on the base) decode
    while adapter c (rank 16, every module) is written into slot 3, which
    grows the packs, with a mixed batch on c and a joining at that step; once
    those finish, slot 3 is cleared, which shrinks them, with the long rows
    still decoding. The hooks run on the engine thread when the first long
    row has a given number of tokens, and queue their work before the next
    step: the schedule is the same in every run. Returns every row's tokens
    and logprobs, what the long rows had generated at each resize, and the
    pack stats after each stage."""
    from helpers.engines import EngineRunner, hold_packs_at_ceilings, together, write_slot

    r = EngineRunner(tiny_model, max_tokens=LONG_TOKENS, pack_compact_idle_s=compact_idle_s)  # no pack yet
    try:
        engine = r.engine
        if at_ceilings:
            engine.call(lambda: hold_packs_at_ceilings(engine.packs)).result()
        stats, published = {}, {}

        # engine thread: the packs as they are, and as the engine last published them
        measure = lambda key: (stats.setdefault(key, engine.packs.stats()),  # noqa: E731
                               published.setdefault(key, engine.pack_stats))

        engine.call(lambda: measure("start")).result()
        r.slots.update(a=1, c=3)
        r.versions.update(a=1, c=1)
        a_weights, c_weights = r.read(adapters["a"]), r.read(adapters["c"])
        lp = dict(logprobs=2)
        long, short, seen, prev = [], [], {}, engine.on_outputs

        def start():  # while the engine waits on the gate: one step takes both rows
            write_slot(r, 1, a_weights)
            long.extend([r.submit(r.prompt(QUESTIONS[3]), "a", **lp), r.submit(r.prompt(QUESTIONS[1]), None, **lp)])

        def hook(outputs):  # engine thread, between two steps
            prev(outputs)
            n = [r.num_tokens.get(s.seq_id, 0) for s in long]
            if "grow" not in seen and n[0] >= 3:
                seen["grow"] = n
                write_slot(r, 3, c_weights)
                engine.call(lambda: measure("grown"))
                short.extend(r.submit(r.prompt(q), name, max_tokens=6, **lp)
                             for q, name in zip(QUESTIONS, ("c", "a", None, "c")))
            elif "grow" in seen and "shrink" not in seen and short and all(s.seq_id in r.done for s in short):
                seen["shrink"] = n
                engine.call(lambda: engine.clear_slot(3))
                engine.call(lambda: measure("shrunk"))

        engine.on_outputs = hook
        together(r, start)
        r.wait(long)
        r.wait(short)
        engine.on_outputs = prev
        # idle now: the engine compacts the packs before it waits for a command
        engine.call(lambda: measure("idle")).result()
        rows = [(s.output, r.logprobs.get(s.seq_id)) for s in long + short]
        return rows, seen, stats, published
    finally:
        r.stop()


def test_packs_grow_and_shrink_under_traffic_with_the_outputs_of_packs_at_the_ceilings(tiny_model, adapters):
    sized, seen, stats, published = _resize_schedule(tiny_model, adapters, at_ceilings=False)
    ceiling, seen_ref, ref_stats, _ = _resize_schedule(tiny_model, adapters, at_ceilings=True)
    # The long rows ran across both resizes.
    assert all(0 < n < LONG_TOKENS for n in seen["grow"] + seen["shrink"]), seen
    assert seen == seen_ref  # the same schedule
    assert sized == ceiling  # tokens and logprobs, every row, bit for bit
    assert all(len(out) == LONG_TOKENS for out, _ in sized[:2])
    # What the packs held: nothing, a's modules at rank 4, everything at 16, back to a's.
    assert stats["start"].nbytes == 0
    assert stats["grown"].ranks == (16,) and stats["grown"].slot_capacity == 4
    assert stats["shrunk"].ranks == (4,) and stats["shrunk"].nbytes < stats["grown"].nbytes / 4
    assert stats["idle"].slot_capacity == 2 and stats["idle"].nbytes < stats["shrunk"].nbytes
    assert stats["idle"].num_packs == stats["shrunk"].num_packs == 2 * 2  # q_proj and v_proj of 2 layers
    assert published == stats  # what /health and /metrics read is current at every stage
    # With a long pack_compact_idle_s the idle engine has not compacted yet: the lazy sizes stay.
    lazy, _, lazy_stats, _ = _resize_schedule(tiny_model, adapters, at_ceilings=False, compact_idle_s=3600)
    assert lazy == sized and lazy_stats["idle"] == lazy_stats["shrunk"] and lazy_stats["idle"].slot_capacity == 4
    # The reference held every pack at the ceilings throughout: 5 slots, rank 16, 14 linears, and the
    # embedding and the head (vocab 512, hidden 64, float32), which no adapter here targets.
    vocab_packs = 2 * 5 * 16 * (512 + 64) * 4
    assert {st.nbytes for st in ref_stats.values()} == {5 * stats["grown"].nbytes // 4 + vocab_packs}


def test_pack_growth_past_the_memory_free_is_refused_with_the_numbers(tiny_model, adapters, monkeypatch):
    """A load whose packs would not fit beside the base and the KV budget
    fails with PacksDoNotFit (507) naming the sizes; its slot is free again
    and the packs hold nothing."""
    import mola.engine.engine as engine_module
    from helpers.engines import EngineRunner, run_registry
    from mola.errors import PacksDoNotFit
    from mola.server.errors import status_of

    r = EngineRunner(tiny_model)
    try:
        monkeypatch.setattr(engine_module, "free_bytes", lambda: 1 << 10)  # 1 KiB free

        async def scenario(registry):
            with pytest.raises(PacksDoNotFit) as e:
                await registry.load("c", str(adapters["c"]))
            message = e.value.message
            assert "grows the slot packs by" in message and "--kv-cache-bytes" in message, message
            assert status_of(e.value)[0] == 507
            assert registry.num_free_slots == registry.max_loras

        run_registry(r.engine, scenario, max_loras=4)
        assert r.engine.pack_stats.nbytes == 0
    finally:
        r.stop()
