"""Speculative decoding's plain-Python half (mola/engine/speculative.py):
prompt lookup against a naive search, the per-row adaptive policy, and the
scheduler's plans."""

from __future__ import annotations

import itertools
import random

import pytest

from mola.engine.config import SpeculativeConfig
from mola.engine.scheduler import Scheduler
from mola.engine.sequence import FinishReason, SamplingParams, Sequence
from mola.engine.speculative import FIRST_LENGTH, MAX_PAUSE, NgramIndex, Proposal, Speculator

_ids = itertools.count()  # the engine numbers sequences (Engine.add); these tests number their own


def naive_draft(tokens: list[int], sizes, k: int, skip: int) -> list[int]:
    """The longest suffix (of the sizes, longest first) that occurred before
    with a token after it; its latest such occurrence; then the tokens after
    it, continued with the draft itself where they run out."""
    m = len(tokens)
    for n in sizes:
        if m <= n:
            continue
        suffix = tokens[m - n:]
        ends = [e for e in range(n, m) if tokens[e - n:e] == suffix]  # e < m: a token follows
        if ends:
            seq = list(tokens)
            while len(seq) < m + skip + k:
                seq.append(seq[ends[-1] + len(seq) - m])
            return seq[m + skip: m + skip + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_prompt_lookup_matches_a_naive_search(seed):
    """Tokens from a small alphabet (many repeats), looked up after every
    token as the index grows, with and without a token in flight."""
    rng = random.Random(seed)
    alphabet = rng.randint(2, 6)
    tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 5))]
    sizes = (4, 3, 2) if seed % 2 else (3, 1)
    index = NgramIndex(sizes)
    index.extend(tokens)
    found = 0
    for _ in range(60):
        k, skip = rng.randint(1, 9), rng.randint(0, 1)
        got = index.draft(k, skip)
        assert got == naive_draft(tokens, sizes, k, skip), (tokens, k, skip)
        found += bool(got)
        new = [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]
        tokens += new
        index.extend(new)
    assert found > 10


def test_a_copy_is_drafted_from_the_prompt_and_a_loop_continues():
    index = NgramIndex((3, 2))
    index.extend([5, 6, 7, 8, 9, 10, 1, 2, 5, 6])  # "5 6" was followed by 7 8 9 ...
    assert index.draft(4) == [7, 8, 9, 10]
    assert index.draft(3, skip=1) == [8, 9, 10]  # 7 is the token in flight
    index.extend([7, 7, 7])
    assert index.draft(5) == [7, 7, 7, 7, 7]  # "7 7" just before: a loop of period 1
    assert NgramIndex((2,)).draft(3) == []


def seq(prompt, max_tokens=100, **kw) -> Sequence:
    return Sequence(prompt=list(prompt), params=SamplingParams(max_tokens=max_tokens, **kw), seq_id=next(_ids))


COPY = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # its suffix 1 2 3 drafts 4 5 6 ...


def test_proposals_grow_with_acceptance_and_fall_back_after_failures():
    spec = Speculator(SpeculativeConfig(num_draft_tokens=16))
    source = list(range(1, 80))
    s = seq(source + [1, 2, 3])  # "repeat this": the output copies the source
    p = spec.propose([s], set())
    assert p.num_draft == [FIRST_LENGTH] and p.tokens == [[4, 5, 6, 7]]
    lengths = []
    for _ in range(3):  # every draft accepted: the length doubles up to the cap
        spec.record(s, p.num_draft[0], p.num_draft[0])
        s.output += p.tokens[0] + [p.tokens[0][-1] + 1]  # the drafts, and the token after them
        p = spec.propose([s], set())
        assert p.tokens[0][0] == s.output[-1] + 1
        lengths.append(spec.state(s).length)
    assert lengths == [8, 16, 16]
    spec.record(s, p.num_draft[0], 2)  # two of sixteen: three tokens next time
    assert spec.state(s).length == 3
    for _ in range(2):  # nothing accepted twice: a pause of one step, then two, ...
        spec.record(s, 3, 0)
    assert spec.state(s).paused == 1
    assert spec.propose([s], set()) is None  # paused: a plain step
    assert spec.propose([s], set()) is not None


def test_a_row_that_keeps_failing_pauses_longer_each_time_up_to_a_limit():
    spec = Speculator(SpeculativeConfig())
    s = seq(COPY)
    spec.propose([s], set())
    pauses = []
    for _ in range(20):
        spec.record(s, 1, 0)
        spec.record(s, 1, 0)
        pauses.append(spec.state(s).paused)
        spec.state(s).paused = 0
    assert pauses[:4] == [1, 2, 4, 8] and max(pauses) == MAX_PAUSE


def test_drafts_never_pass_max_tokens():
    """A step yields the drafts accepted plus one token, after the token in
    flight when there is one."""
    spec = Speculator(SpeculativeConfig(num_draft_tokens=8))
    for max_tokens, done, in_flight, expected in [(10, 0, False, 4), (10, 7, False, 2), (10, 7, True, 1),
                                                   (10, 8, True, 0), (10, 9, False, 0), (3, 0, False, 2)]:
        s = seq(COPY, max_tokens=max_tokens)
        s.output = [0] * done
        p = spec.propose([s], {s.seq_id} if in_flight else set())
        assert (p.num_draft[0] if p else 0) == expected, (max_tokens, done, in_flight)


def test_big_batches_and_constrained_rows_do_not_speculate():
    spec = Speculator(SpeculativeConfig(max_batch=3))
    rows = [seq(COPY) for _ in range(4)]
    assert spec.propose(rows, set()) is None
    rows[0].constraint = object()  # a grammar row decodes one token at a time
    p = spec.propose(rows[:3], set())
    assert p.num_draft == [0, FIRST_LENGTH, FIRST_LENGTH] and p.tokens[0] == []
    draft = Speculator(SpeculativeConfig(method="draft", draft_model="m", max_batch=3))
    p = draft.propose(rows[:3], set())
    assert p.num_draft == [0, FIRST_LENGTH, FIRST_LENGTH] and p.tokens is None


def test_state_is_kept_for_running_rows_only():
    spec = Speculator(SpeculativeConfig())
    a, b = seq(COPY), seq(COPY)
    spec.propose([a, b], set())
    spec.propose([b], set())
    assert set(spec._states) == {b.seq_id}


def test_the_scheduler_plans_drafts_and_knows_which_tokens_are_in_flight():
    """The first step after a join drafts from the prompt; after a plain
    step the next token is in flight and lookup skips it; a speculative
    step leaves nothing in flight."""
    s = Scheduler(max_num_seqs=4, prefill_step_size=64, speculator=Speculator(SpeculativeConfig()))
    q, other = seq(COPY), seq([7, 8, 9, 10])
    s.add(q)
    s.add(other)
    plan = s.schedule()
    assert plan.decode == [q, other] and plan.proposal == Proposal([4, 0], [[4, 5, 6, 7], []])
    q.output += [4, 5, 6, 7, 8]  # the speculative step's tokens
    other.output += [11]
    s.speculator.state(q).paused = 1
    plan = s.schedule()
    assert plan.proposal is None  # no row drafts: a plain step, left in flight
    plan = s.schedule()
    # 1 2 3 4 5 6 7 8 | in flight | ...: "7 8" was followed by 9, the guess
    # for the token in flight; the draft goes on after it
    assert plan.proposal.num_draft[0] > 0 and plan.proposal.tokens[0][:3] == [1, 2, 3]


def test_unfed_tokens_are_not_stored_in_the_prompt_cache():
    """A row that leaves after a speculative step holds no KV state for its
    last token: the prompt cache stores the tokens before it."""
    from mola.engine.prompt_cache import PromptCache

    s = Scheduler(max_num_seqs=4, prefill_step_size=64, prompt_cache=PromptCache(10**6, 10))
    q = seq(COPY)
    s.add(q)
    s.schedule()
    q.output, q.num_unfed_tokens = [4, 5, 6], 1
    q.finish(FinishReason.LENGTH)
    plan = s.schedule()
    assert [(row, n) for row, _, n in plan.cache.store_rows] == [(0, len(COPY) + 2)]


def test_drafts_not_verified_still_teach_the_acceptance_rate():
    """A row whose drafts the costs turned down checks them against the
    tokens that come: right guesses raise its rate, wrong ones lower it."""
    spec = Speculator(SpeculativeConfig())
    source = list(range(1, 60))
    right, wrong = seq(source + [1, 2, 3]), seq(source + [1, 2, 3])
    spec.propose([right, wrong], set())
    for st in (spec.state(right), spec.state(wrong)):
        st.rate, st.length = 0.4, 1
    for step in range(12):  # plain steps: one token each, known one step late
        right.output.append(4 + step)  # the copy goes on: the guesses were right
        wrong.output.append(99 + step)
        spec.propose([right, wrong], {right.seq_id, wrong.seq_id})
    assert spec.state(right).rate > 0.6 and spec.state(right).length > 2
    assert spec.state(wrong).rate < 0.4 and spec.state(wrong).length == 1
    assert spec.state(right).drafted == 0  # nothing was verified
