"""Scheduling decisions and postprocessing, plain Python (mola/engine/scheduler.py),
and a sequence's lifecycle (mola/engine/sequence.py)."""

from __future__ import annotations

import itertools

import pytest

from mola.engine.scheduler import Scheduler
from mola.engine.sequence import FinishReason, InvalidTransition, SamplingParams, Sequence, SequenceStatus

_ids = itertools.count()  # the engine numbers sequences (Engine.add); these tests number their own


def seq(n_prompt, max_tokens=4):
    return Sequence(prompt=list(range(1, n_prompt + 1)), params=SamplingParams(max_tokens=max_tokens),
                    seq_id=next(_ids))


def test_short_prompts_prefill_together_and_join_in_one_step():
    s = Scheduler(max_num_seqs=8, prefill_step_size=64)
    seqs = [seq(5), seq(9), seq(3)]
    for q in seqs:
        s.add(q)
    plan = s.schedule()
    assert plan.prefill == seqs and plan.prefill_is_new
    assert (plan.start, plan.end) == (0, 8)  # longest prompt minus its last token
    assert plan.join == [0, 1, 2] and plan.decode == seqs
    assert all(q.status is SequenceStatus.RUNNING for q in seqs)


def test_long_prompt_is_chunked_while_others_decode():
    s = Scheduler(max_num_seqs=8, prefill_step_size=16)
    first = seq(3)
    s.add(first)
    s.schedule()  # first joins the decode batch
    long = seq(41)  # 40 tokens to prefill: chunks of 16
    s.add(long)
    spans = []
    while True:
        plan = s.schedule()
        assert first in plan.decode  # decoding never waits for the prefill
        spans.append((plan.start, plan.end))
        if plan.join is not None:
            break
        assert long not in plan.decode
    assert spans == [(0, 16), (16, 32), (32, 40)]
    assert plan.decode == [first, long]


def test_prefill_batch_is_limited_by_step_budget_and_capacity():
    s = Scheduler(max_num_seqs=3, prefill_step_size=20)
    qs = [seq(8) for _ in range(5)]
    for q in qs:
        s.add(q)
    plan = s.schedule()
    assert plan.prefill == qs[:2]  # a third 7-token prompt would exceed 20 padded tokens
    plan = s.schedule()
    assert plan.prefill == qs[2:3]  # only one row left under max_num_seqs=3
    plan = s.schedule()
    assert plan.prefill == [] and len(plan.decode) == 3 and len(s.waiting) == 2


def test_finished_rows_leave_and_aborts_are_honoured():
    s = Scheduler(max_num_seqs=8, prefill_step_size=64)
    a, b, c = seq(2), seq(2), seq(2)
    for q in (a, b, c):
        s.add(q)
    s.schedule()
    b.finish(FinishReason.LENGTH)
    plan = s.schedule()
    assert plan.keep == [0, 2] and plan.decode == [a, c]
    s.add(d := seq(2))
    assert s.abort(d.seq_id) is d and d.finish_reason == "abort" and not s.waiting
    assert s.abort(a.seq_id) is a
    plan = s.schedule()
    assert plan.keep == [1] and plan.decode == [c]


def test_one_token_prompts_join_without_prefill():
    s = Scheduler()
    q = seq(1)
    s.add(q)
    plan = s.schedule()
    assert (plan.start, plan.end) == (0, 0) and plan.join == [0] and plan.decode == [q]


def test_expired_sequences_leave_the_queue_or_stop():
    s = Scheduler(max_num_seqs=1, prefill_step_size=64)
    running, queued, fresh = seq(3), seq(3), seq(3)
    running.deadline, queued.deadline, fresh.deadline = 10.0, 10.0, 99.0
    for q in (running, queued, fresh):
        s.add(q)
    s.schedule()  # `running` takes the only row
    assert s.expire(now=5.0) == []
    assert s.expire(now=11.0) == [queued, running]
    assert queued.finish_reason == "timeout" and running.finish_reason == "length"
    assert list(s.waiting) == [fresh]
    plan = s.schedule()
    assert plan.keep == [] and plan.prefill == [fresh]


def test_take_batch_and_take_all_empty_what_they_say():
    s = Scheduler(max_num_seqs=8, prefill_step_size=4)
    running, long, queued = seq(3), seq(20), seq(2)
    s.add(running)
    s.schedule()  # running joins the batch
    s.add(long)
    s.schedule()  # long is prefilling (20 tokens in chunks of 4)
    s.add(queued)
    running_done = seq(2)
    running_done.finish(FinishReason.STOP)
    s.running.append(running_done)  # a finished row not yet dropped is not handed back
    assert s.take_batch() == [long, running]
    assert not s.running and not s.prefilling and list(s.waiting) == [queued]
    s.schedule()
    assert s.take_all() == [queued] and not s.has_work()


def test_prompt_cache_orders_in_the_plan():
    """Hits shorten the prefill batch's columns; joining members and leaving rows are
    stored (prompt, then prompt and output); identities never mix."""
    from mola.engine.prompt_cache import PromptCache

    cache = PromptCache(max_bytes=10_000, cost=1)
    s = Scheduler(max_num_seqs=8, prefill_step_size=128, prompt_cache=cache)
    first = seq(21)
    s.add(first)
    plan = s.schedule()
    assert plan.cache.hits == [None] and (plan.start, plan.end) == (0, 20)
    assert [(i, n) for i, _, n in plan.cache.store_joined] == [(0, 20)]  # its prompt but the last token
    first.append(7)
    first.finish(FinishReason.STOP)
    again, other_scale, adapter = seq(21), seq(21), seq(21)
    adapter.slot, adapter.adapter_key = 1, ("a", 1)
    other_scale.slot, other_scale.adapter_key, other_scale.lora_scale = 1, ("a", 1), 0.5
    unknown = seq(21)
    unknown.slot = 2  # an adapter row with no key is never cached
    for q in (again, other_scale, adapter, unknown):
        q.prompt = first.prompt + [7] + [99] * 4  # the next turn, and other identities
        s.add(q)
    plan = s.schedule()
    (row, entry, n), = plan.cache.store_rows
    assert (row, n) == (0, 22) and plan.keep == []  # prompt + output
    assert plan.cache.evict and plan.cache.evict[0] != entry  # the joined prompt's entry is a prefix of it
    assert plan.cache.hits[0].entry == entry and plan.cache.hits[0].num_tokens == 22
    assert plan.cache.hits[1:] == [None, None, None]
    assert [q.num_cached_tokens for q in (again, other_scale, adapter, unknown)] == [22, 0, 0, 0]
    assert (plan.start, plan.end) == (0, 25)  # the longest uncached part, not 25 + 22
    assert cache.stats().hits == 1 and cache.stats().misses == 3  # first, other_scale, adapter


def test_postprocess_hands_out_tokens_up_to_the_end_and_reports_expiry_first():
    """Each row takes its tokens up to the one that ends it; a row finished
    while the step ran gets nothing; sequences that expired when the step
    was planned come first. The outputs carry no Sequence, only copies."""
    from mola.engine.plan import StepResult

    s = Scheduler(max_num_seqs=8, prefill_step_size=64)
    stops = Sequence(prompt=[1, 2], params=SamplingParams(max_tokens=9, stop_token_ids=frozenset({5})),
                     seq_id=next(_ids))
    short, gone, late = seq(2, max_tokens=2), seq(2), seq(2)
    for q in (stops, short, gone):
        s.add(q)
    s.schedule()
    late.deadline = 1.0
    s.add(late)
    s.schedule(now=2.0)  # `late` expires before it is planned
    s.abort(gone.seq_id)
    result = StepResult([stops, short, gone], [[4, 5, 6], [7, 8, 9], [1]], [None, None, None], [True, True, False])
    outs = s.postprocess(result)
    assert [(o.seq_id, o.tokens, o.finish_reason) for o in outs] == [
        (late.seq_id, (), FinishReason.TIMEOUT),
        (stops.seq_id, (4, 5), FinishReason.STOP),  # 6 came after the stop token
        (short.seq_id, (7, 8), FinishReason.LENGTH),
    ]
    assert stops.output == [4, 5] and short.output == [7, 8] and gone.output == []
    assert stops.num_unfed_tokens == 0  # the unfed token (6) was not taken
    assert s.postprocess(None) == []  # reported once
    assert not hasattr(outs[0], "seq")
    with pytest.raises(AttributeError):
        outs[0].tokens = (1,)  # frozen


def test_a_sequence_moves_only_along_its_lifecycle():
    """Every (from, to) pair of statuses against the lifecycle written out
    here: waiting -> prefilling -> running, finished from any other, and
    back to waiting from prefilling or running (preempted by the KV budget)."""
    S = SequenceStatus
    allowed = {(S.WAITING, S.PREFILLING), (S.PREFILLING, S.RUNNING),
               (S.WAITING, S.FINISHED), (S.PREFILLING, S.FINISHED), (S.RUNNING, S.FINISHED),
               (S.PREFILLING, S.WAITING), (S.RUNNING, S.WAITING)}
    path = [S.WAITING, S.PREFILLING, S.RUNNING]

    def at(status):
        q = seq(3)
        if status is S.FINISHED:
            q.finish(FinishReason.ABORT)
            return q
        for step in path[1:path.index(status) + 1]:
            q.move_to(step)
        return q

    for a in S:
        for b in S:
            q = at(a)
            if (a, b) in allowed:
                q.move_to(b, FinishReason.STOP if b is S.FINISHED else None)
                assert q.status is b
            else:
                with pytest.raises(InvalidTransition):
                    q.move_to(b, FinishReason.STOP if b is S.FINISHED else None)
                assert q.status is a
    with pytest.raises(InvalidTransition):
        seq(3).move_to(S.FINISHED)  # finishing needs a reason
    with pytest.raises(InvalidTransition):
        seq(3).move_to(S.PREFILLING, FinishReason.STOP)  # and only finishing takes one
    with pytest.raises(ValueError):
        seq(3).finish("done")  # not a finish reason


def test_finish_reasons_are_the_api_strings():
    import json

    for reason, text in [(FinishReason.STOP, "stop"), (FinishReason.LENGTH, "length"),
                         (FinishReason.ABORT, "abort"), (FinishReason.TIMEOUT, "timeout"),
                         (FinishReason.ERROR, "error")]:
        assert reason == text and f"{reason}" == text and json.dumps(reason) == f'"{text}"'
