"""Speculative decoding, its plain-Python half: which rows draft, and what.

A step that speculates feeds every decode row its next input followed by the
tokens it drafted (none for a row that does not speculate), right-padded to
one width, and the target model verifies them all in one forward pass, each
row with its own adapter, scale and sampling (mola.engine.verify, the
runner's half). This module decides, per step and per row, how many tokens
to draft and, for prompt lookup, which:

- Prompt lookup ("ngram"): the row's last n tokens (n from prompt_lookup_max
  down to prompt_lookup_min) are looked up in its prompt and output so far;
  the tokens that followed their latest earlier occurrence are the draft
  (continued periodically when the match is close behind, as in a loop). An
  index per row makes each lookup a few dictionary reads.
- A draft model ("draft"): the runner drafts on the device; this side only
  says how many tokens each row drafts.

It adapts. A row's draft length doubles while its drafts are accepted in
full and drops to what was accepted, plus one, when they are not; a row whose
drafts keep failing stops drafting for a while, longer each time. Drafts
that were not verified are checked against the tokens that come, so a row's
length and acceptance rate follow its text whether or not it speculates. A step
speculates only when it pays: the time of steps is learned as they run
(mola.engine.step_costs: seconds against positions computed), each row's
acceptance rate predicts how many of its drafts it will keep, and the step
takes the draft width with the most tokens per second, or none when a plain
step yields more (now and then it tries again, to see whether costs
changed). A step with more rows than max_batch does not speculate, and a
step in which no row drafts is the plain pipelined decode step, unchanged.

Plain steps are pipelined, so when the next step is planned the token that a
plain step sampled for each row is still on the device ("in flight"). Prompt
lookup then matches the tokens known and skips one: the token that followed
the match is its guess for the one in flight. Verification is exact whatever
the draft, so a wrong guess costs only the positions it wastes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .config import SpeculativeConfig
from .sequence import Sequence
from .step_costs import StepCosts

log = logging.getLogger("mola.engine")

FIRST_LENGTH = 4  # tokens a row drafts at first (capped by num_draft_tokens)
FAILURES_TO_PAUSE = 2  # verified steps in a row that accept nothing before a pause
MAX_PAUSE = 64  # steps; a pause doubles each time, up to this
FIRST_RATE = 0.6  # a row's acceptance rate before any of its drafts was checked
RATE_STEP = 0.2  # how far one checked draft token moves the rate towards what it showed
# Steps with drafts that the costs turned down before one speculates anyway
# (to see whether the costs changed): EXPLORE_CLOSE when the expected tokens
# per second came within CLOSE of a plain step's. Acceptance rates need no
# exploring (drafts turned down are checked against the tokens that come),
# and a turned-down step costs what it falls short by, which on a CPU is much:
# at CLOSE = 0.8 a batch of 4 or 8 copying rows on mixed adapters explored
# one step in 8 at some 20-60% below a plain step's tokens per second, and
# lost 15-25% in all (benchmarks/README.md, speculative decoding). Exploring
# now loses at most (1 - CLOSE) / EXPLORE_CLOSE + 1 / EXPLORE_EVERY, about 2%.
EXPLORE_EVERY = 64
EXPLORE_CLOSE = 8
CLOSE = 0.95


def expected_accepted(rate: float, drafted: int) -> float:
    """Drafts a row keeps, when each is accepted (after the ones before it)
    with probability ``rate``: rate + rate^2 + ... + rate^drafted."""
    return sum(rate ** j for j in range(1, drafted + 1))


class NgramIndex:
    """A growing token list, and where each of its n-grams last occurred
    with a token after it."""

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes  # n-gram sizes, the longest first
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._indexed = 1  # n-grams ending before this position are in _ends

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def _index(self) -> None:
        t = self.tokens
        for end in range(self._indexed, len(t)):  # each end has t[end] after it
            for n in self.sizes:
                if end >= n:
                    self._ends[tuple(t[end - n:end])] = end
        self._indexed = max(self._indexed, len(t))

    def draft(self, k: int, skip: int = 0) -> list[int]:
        """Up to ``k`` tokens that follow the longest suffix seen before, after
        ``skip`` tokens not known yet; [] when no suffix was seen before."""
        if k <= 0:
            return []
        self._index()
        t, m = self.tokens, len(self.tokens)
        for n in self.sizes:
            end = self._ends.get(tuple(t[m - n:])) if m > n else None
            if end is not None:
                period = m - end  # what follows the suffix, as it followed the match
                return [t[end + (skip + j) % period] for j in range(k)]
        return []


@dataclass
class RowState:
    """One running sequence's speculation."""

    index: NgramIndex | None  # prompt lookup's tokens and n-grams (None: a draft model drafts)
    length: int  # tokens it drafts next
    seen: int = 0  # tokens of prompt and output given to the index
    failures: int = 0  # verified steps in a row that accepted nothing
    pause: int = 1  # steps the next pause lasts
    paused: int = 0  # steps left without drafting
    rate: float = FIRST_RATE  # estimated chance that a draft is accepted, given the ones before it
    # A draft not verified, to check against the tokens that come: (where its
    # first token goes in prompt + output, its tokens).
    shadow: tuple[int, list[int]] | None = None
    drafted: int = 0  # totals, for tests and logs
    accepted: int = 0


@dataclass
class Proposal:
    """What a step drafts: per decode row, the number of tokens, and for
    prompt lookup the tokens themselves."""

    num_draft: list[int]
    tokens: list[list[int]] | None = None  # None: a draft model drafts them


def make_speculator(config: SpeculativeConfig | None, can_rewind: bool) -> Speculator | None:
    """The engine's speculator: None without --speculative, or (with a
    warning) for a model whose KV caches cannot be cut back by a step's drafts
    (a sliding window's can: verify.rewind_window; not a draft model's)."""
    if config is None:
        return None
    if not can_rewind:
        log.warning("speculative decoding off: this model's KV caches cannot be cut at a token "
                    "(recurrent state, --kv-bits, or a draft model with sliding windows)")
        return None
    return Speculator(config)


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.sizes = tuple(range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1))
        self._states: dict[int, RowState] = {}  # seq_id -> state, for running rows only
        self.costs = StepCosts()
        self._since_speculating = 0  # steps since the last speculative one, while drafts were on hand
        # the step being timed: (start, positions, speculative)
        self._timing: tuple[float, int, bool] | None = None

    @property
    def uses_lookup(self) -> bool:
        return self.config.method == "ngram"

    def state(self, seq: Sequence) -> RowState:
        st = self._states.get(seq.seq_id)
        if st is None:
            index = NgramIndex(self.sizes) if self.uses_lookup else None
            st = self._states[seq.seq_id] = RowState(index, min(FIRST_LENGTH, self.config.num_draft_tokens))
        return st

    def propose(self, rows: list[Sequence], in_flight: set[int]) -> Proposal | None:
        """What ``rows`` (a step's decode rows) draft; None: none drafts, and
        the step is a plain one. ``in_flight``: ids of rows whose last token
        is still being computed."""
        self._states = {s.seq_id: self._states[s.seq_id] for s in rows if s.seq_id in self._states}
        if not rows or len(rows) > self.config.max_batch:
            return None
        counts, tokens = [], []
        for seq in rows:
            draft = self._draft(seq, int(seq.seq_id in in_flight))
            counts.append(len(draft) if self.uses_lookup else draft)
            tokens.append(draft if self.uses_lookup else [])
        if not any(counts):
            return None
        width = self._width(rows, counts)
        if width == 0:
            self._since_speculating += 1
            return None
        self._since_speculating = 0
        counts = [min(c, width) for c in counts]
        return Proposal(counts, [t[:width] for t in tokens] if self.uses_lookup else None)

    def _width(self, rows: list[Sequence], counts: list[int]) -> int:
        """The draft width with the most tokens per second, 0 when a plain
        step is expected to yield more."""
        costs, B, widest = self.costs, len(rows), max(counts)
        if not self.config.cost_aware or not costs.knows_plain:
            return widest
        plain = B / max(costs.plain(B), 1e-6)  # tokens per second
        rates = [self.state(s).rate if c else 0.0 for s, c in zip(rows, counts)]
        best, best_rate, width = 0, 0.0, 1
        while True:
            width = min(width, widest)
            expected = B + sum(expected_accepted(r, min(c, width)) for r, c in zip(rates, counts))
            rate = expected / max(costs.speculative(B * (1 + width), B), 1e-6)
            if rate > best_rate:
                best, best_rate = width, rate
            if width == widest:
                break
            width *= 2
        if best_rate > plain:
            return best
        # Turned down: look again now and then, sooner when it was close.
        again = EXPLORE_CLOSE if best_rate > CLOSE * plain else EXPLORE_EVERY
        return best if self._since_speculating >= again else 0

    def clock(self, now: float, rows: int, width: int | None, prefill: bool) -> None:
        """A step is planned at ``now``: the one before it took until now.
        This one decodes ``rows`` rows, verifying ``width`` positions each
        (None: a plain step); a step that also prefills is not timed."""
        if self._timing is not None:
            start, positions, speculative = self._timing
            self.costs.observe(positions, now - start, speculative)
        self._timing = None
        if rows and not prefill:
            self._timing = (now, rows * (width or 1), width is not None)

    def _draft(self, seq: Sequence, lag: int):
        """Prompt lookup's tokens for one row (a draft model: how many)."""
        if seq.constraint is not None:  # grammar rows decode one token at a time
            return [] if self.uses_lookup else 0
        st = self.state(seq)
        # the step yields up to k + 1 tokens after the one in flight
        k = min(st.length, seq.params.max_tokens - seq.num_output_tokens - lag - 1)
        if st.paused > 0:
            st.paused -= 1
            k = 0
        if not self.uses_lookup:
            return max(k, 0)
        if st.seen == 0:
            st.index.extend(seq.prompt)
            st.seen = seq.num_prompt_tokens
        new = seq.num_prompt_tokens + seq.num_output_tokens - st.seen
        if new > 0:
            st.index.extend(seq.output[-new:])
            st.seen += new
        self._check_shadow(st)
        draft = st.index.draft(k, skip=lag)
        if st.shadow is None:  # what it would draft, checked against what comes
            guess = draft or st.index.draft(st.length, skip=lag)
            st.shadow = (len(st.index.tokens) + lag, guess) if guess else None
        return draft

    def _check_shadow(self, st: RowState) -> None:
        """Learn from a draft that was not verified, now that the tokens it
        guessed are known (drafts turned down cost nothing, and tell whether
        the row's drafts are right again)."""
        if st.shadow is None:
            return
        start, guess = st.shadow
        known = st.index.tokens[start:start + len(guess)]
        matched = next((i for i, (a, b) in enumerate(zip(known, guess)) if a != b), len(known))
        if matched < len(known) or len(known) == len(guess):
            self._learn(st, len(guess), matched)
            st.shadow = None

    def _learn(self, st: RowState, drafted: int, accepted: int) -> None:
        """Draft length and acceptance rate after ``accepted`` of ``drafted``
        were right: a + 1 trials and a successes (all accepted: d trials,
        and one more success assumed), each trial moving the rate by
        RATE_STEP."""
        if accepted >= drafted:
            st.length = min(self.config.num_draft_tokens, 2 * st.length)
            seen, trials = (drafted + 1) / (drafted + 2), drafted
        else:
            st.length = accepted + 1
            seen, trials = accepted / (accepted + 1), accepted + 1
        keep = (1 - RATE_STEP) ** trials
        st.rate = keep * st.rate + (1 - keep) * seen

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified step accepted ``accepted`` of the ``drafted`` tokens of ``seq``."""
        st = self._states.get(seq.seq_id)
        if st is None or drafted == 0:
            return
        st.drafted += drafted
        st.accepted += accepted
        st.shadow = None  # verified instead
        self._learn(st, drafted, accepted)
        if accepted > 0:
            st.failures = 0
            st.pause = max(1, st.pause // 2)
            return
        st.failures += 1
        if st.failures >= FAILURES_TO_PAUSE:
            st.paused, st.pause = st.pause, min(MAX_PAUSE, 2 * st.pause)
            st.failures = 0
