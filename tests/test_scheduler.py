"""Scheduling decisions, plain Python (mola/engine/scheduler.py)."""

from __future__ import annotations

from mola.engine.scheduler import Scheduler
from mola.engine.sequence import SamplingParams, Sequence, SequenceStatus


def seq(n_prompt, max_tokens=4):
    return Sequence(prompt=list(range(1, n_prompt + 1)), params=SamplingParams(max_tokens=max_tokens))


def test_short_prompts_prefill_together_and_join_in_one_step():
    s = Scheduler(max_num_seqs=8, prefill_step_size=64)
    seqs = [seq(5), seq(9), seq(3)]
    for q in seqs:
        s.add(q)
    plan = s.schedule()
    assert plan.group == seqs and plan.group_is_new
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


def test_group_is_limited_by_step_budget_and_capacity():
    s = Scheduler(max_num_seqs=3, prefill_step_size=20)
    qs = [seq(8) for _ in range(5)]
    for q in qs:
        s.add(q)
    plan = s.schedule()
    assert plan.group == qs[:2]  # a third 7-token prompt would exceed 20 padded tokens
    plan = s.schedule()
    assert plan.group == qs[2:3]  # only one row left under max_num_seqs=3
    plan = s.schedule()
    assert plan.group == [] and len(plan.decode) == 3 and len(s.waiting) == 2


def test_finished_rows_leave_and_aborts_are_honoured():
    s = Scheduler(max_num_seqs=8, prefill_step_size=64)
    a, b, c = seq(2), seq(2), seq(2)
    for q in (a, b, c):
        s.add(q)
    s.schedule()
    b.finish("length")
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
    assert plan.keep == [] and plan.group == [fresh]


def test_take_batch_and_take_all_empty_what_they_say():
    s = Scheduler(max_num_seqs=8, prefill_step_size=4)
    running, long, queued = seq(3), seq(20), seq(2)
    s.add(running)
    s.schedule()  # running joins the batch
    s.add(long)
    s.schedule()  # long is prefilling (20 tokens in chunks of 4)
    s.add(queued)
    running_done = seq(2)
    running_done.finish("stop")
    s.running.append(running_done)  # a finished row not yet dropped is not handed back
    assert s.take_batch() == [long, running]
    assert not s.running and not s.group and list(s.waiting) == [queued]
    s.schedule()
    assert s.take_all() == [queued] and not s.has_work()


def test_prompt_cache_orders_in_the_plan():
    """Hits shorten the group's columns; joining members and leaving rows are
    stored (prompt, then prompt and output); identities never mix."""
    from mola.engine.prompt_cache import PromptCache

    cache = PromptCache(max_bytes=10_000, bytes_per_token=1)
    s = Scheduler(max_num_seqs=8, prefill_step_size=128, prompt_cache=cache)
    first = seq(21)
    s.add(first)
    plan = s.schedule()
    assert plan.hits == [None] and (plan.start, plan.end) == (0, 20)
    assert [(i, n) for i, _, n in plan.store_joined] == [(0, 20)]  # its prompt but the last token
    first.append(7)
    first.finish("stop")
    again, other_scale, adapter = seq(21), seq(21), seq(21)
    adapter.slot, adapter.adapter_key = 1, ("a", 1)
    other_scale.slot, other_scale.adapter_key, other_scale.lora_scale = 1, ("a", 1), 0.5
    unknown = seq(21)
    unknown.slot = 2  # an adapter row with no key is never cached
    for q in (again, other_scale, adapter, unknown):
        q.prompt = first.prompt + [7] + [99] * 4  # the next turn, and other identities
        s.add(q)
    plan = s.schedule()
    (row, entry, n), = plan.store_rows
    assert (row, n) == (0, 22) and plan.keep == []  # prompt + output
    assert plan.evict and plan.evict[0] != entry  # the joined prompt's entry is a prefix of it
    assert plan.hits[0].entry == entry and plan.hits[0].num_tokens == 22
    assert plan.hits[1:] == [None, None, None]
    assert [q.num_cached_tokens for q in (again, other_scale, adapter, unknown)] == [22, 0, 0, 0]
    assert (plan.start, plan.end) == (0, 25)  # the longest uncached part, not 25 + 22
    assert cache.stats().hits == 1 and cache.stats().misses == 3  # first, other_scale, adapter
