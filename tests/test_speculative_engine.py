"""Speculative decoding in the engine (mola/engine/speculative.py,
verify.py, runner.py), on real mlx-lm models: greedy outputs equal plain
mlx-lm on merged weights and mola without speculation, alone and in mixed
batches of adapters, scales and rows that do not speculate; with sampling,
penalties, biases, log-probabilities, stop tokens, max_tokens, grammars, the
prompt cache and aborts, rows behave exactly as without speculation."""

from __future__ import annotations

import pytest

from mola.engine.config import SpeculativeConfig
from mola.models.loader import ModelLoadError, load_base_model, load_draft_model
from mola.testing.model import TinyModelSpec, make_tiny_model

from helpers.engines import EngineRunner as Runner
from helpers.engines import runner_stats
from helpers.references import greedy_tokens, merged_model

MESSAGES = ["hello world, how are you?", "the quick brown fox jumps over the lazy dog",
            "Please call me at 555-0199!"]
MAX_TOKENS = 32
WIDE = dict(max_batch=32, num_draft_tokens=6, cost_aware=False)  # every batch with drafts speculates


@pytest.fixture(scope="module")
def echo(echo_demo):
    """Engines on the echo base (it copies the message: prompt lookup's
    drafts are mostly right) with two of its adapters (upper, title: the
    drafts copied from the message are then partly wrong), with and without
    speculation."""
    base, adapters = echo_demo
    chosen = [("upper", adapters["upper"]), ("title", adapters["title"])]
    spec = Runner(base, adapters=chosen, max_tokens=MAX_TOKENS, speculative=SpeculativeConfig(**WIDE))
    plain = Runner(base, adapters=chosen, max_tokens=MAX_TOKENS)
    yield spec, plain, base, adapters
    spec.stop()
    plain.stop()


@pytest.fixture(scope="module")
def echo_refs(echo):
    """Greedy tokens of plain mlx-lm with the adapter merged into the weights."""
    spec, _, base, adapters = echo
    refs = {}
    for name, scale in [(None, 1.0), ("upper", 1.0), ("title", 1.0), ("upper", 0.5)]:
        model, _ = merged_model(base, [adapters[name]] if name else [], [scale])
        for m in MESSAGES:
            refs[name, scale, m] = greedy_tokens(model, spec.prompt(m), MAX_TOKENS)
    return refs


@pytest.mark.slow
def test_greedy_copies_equal_merged_mlx_lm_alone_and_in_a_mixed_batch(echo, echo_refs):
    spec, plain, _, _ = echo
    before = runner_stats(spec.engine)
    drafted, accepted = before.draft_tokens, before.accepted_tokens
    jobs = list(echo_refs)
    seqs = [spec.submit(spec.prompt(m), name, lora_scale=scale) for name, scale, m in jobs]
    for job, out in zip(jobs, spec.wait(seqs)):
        assert out == echo_refs[job], job
    for name, scale, m in jobs[::3]:  # alone too
        assert spec.run(spec.prompt(m), name, lora_scale=scale) == echo_refs[name, scale, m]
    st = runner_stats(spec.engine)
    assert st.accepted_tokens - accepted > 60  # the copies were drafted and accepted ...
    assert st.draft_tokens - drafted > st.accepted_tokens - accepted  # ... and some drafts were not
    assert len({tuple(echo_refs[j]) for j in jobs if j[2] == MESSAGES[0]}) == 4  # adapters differ


def test_staggered_arrivals_join_a_speculating_batch(echo, echo_refs):
    """Rows join while others speculate, beside rows with no draft at all."""
    spec, _, _, _ = echo
    first = [spec.submit(spec.prompt(m), "title") for m in MESSAGES]
    spec.wait_decoding(first)
    later = [spec.submit(spec.prompt(m), name, lora_scale=s) for m in MESSAGES for name, s in
             [(None, 1.0), ("upper", 0.5)]]
    spec.wait(first + later)
    assert [s.output for s in first] == [echo_refs["title", 1.0, m] for m in MESSAGES]
    assert [s.output for s in later] == [echo_refs[n, s, m] for m in MESSAGES for n, s in
                                         [(None, 1.0), ("upper", 0.5)]]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 9])
def test_max_tokens_is_never_passed(echo, echo_refs, max_tokens):
    spec, _, _, _ = echo
    seqs = [spec.submit(spec.prompt(m), None, max_tokens=max_tokens) for m in MESSAGES]
    for seq, m in zip(seqs, MESSAGES):
        spec.wait([seq])
        assert seq.output == echo_refs[None, 1.0, m][:max_tokens] and seq.finish_reason == "length"


def test_stop_tokens_among_accepted_drafts_end_the_row_there(echo, echo_refs):
    spec, _, _, _ = echo
    eos = spec.loaded.tokenizer.eos_token_ids
    short = [m for m in MESSAGES if set(echo_refs[None, 1.0, m]) & eos]
    assert len(short) >= 2
    for m in short:
        seq = spec.submit(spec.prompt(m), None, stop_token_ids=frozenset(eos))
        spec.wait([seq])
        ref = echo_refs[None, 1.0, m]
        end = next(i for i, t in enumerate(ref) if t in eos)
        assert seq.output == ref[: end + 1] and seq.finish_reason == "stop"


@pytest.mark.slow
def test_logprobs_penalties_and_biases_are_those_without_speculation(echo):
    spec, plain, _, _ = echo
    tok = spec.loaded.tokenizer
    space, e = tok.encode(" ")[-1], tok.encode("e")[-1]
    params = [dict(frequency_penalty=0.3, presence_penalty=0.2, logprobs=3),
              dict(logit_bias=((e, -3.0), (space, 1.5))), dict(temperature=0.8, top_p=0.9, seed=5, logprobs=0)]
    jobs = [(p, name, m) for p in params for name in (None, "title") for m in MESSAGES[1:]]
    outs = [[r.submit(r.prompt(m), name, **p) for p, name, m in jobs] for r in (spec, plain)]
    for r, seqs in zip((spec, plain), outs):
        r.wait(seqs)
    for job, x, y in zip(jobs, *outs):
        assert x.output == y.output, job


def test_logprobs_of_accepted_tokens_are_the_targets(echo):
    """Per token, the log-probability of a speculative step's token equals
    the plain step's (the same model, one position at a time)."""
    spec, plain, _, _ = echo
    got = {}
    for runner in (spec, plain):
        outs = []
        prev = runner.engine.on_outputs

        def keep(outputs, outs=outs, prev=prev):
            outs.extend(o for o in outputs if o.logprobs)
            prev(outputs)

        runner.engine.on_outputs = keep
        try:
            runner.run(runner.prompt(MESSAGES[1]), "title", logprobs=2)
        finally:
            runner.engine.on_outputs = prev
        got[runner is spec] = [lp for o in outs for lp in o.logprobs]
    assert len(got[True]) == len(got[False]) == MAX_TOKENS
    for (c1, top1), (c2, top2) in zip(got[True], got[False]):
        assert c1 == pytest.approx(c2, abs=1e-4)
        assert [t for t, _ in top1] == [t for t, _ in top2]


def test_constrained_rows_beside_speculating_rows_are_unchanged(echo):
    from mola.structured import StructuredOutputs

    spec, plain, _, _ = echo
    outputs = {}
    for runner in (spec, plain):
        so = StructuredOutputs(runner.loaded.tokenizer, runner.loaded.vocab_size)
        grammar = so.for_request(response_format={"type": "json_object"})
        eos = frozenset(runner.loaded.tokenizer.eos_token_ids)
        seqs = [runner.submit(runner.prompt('{"city": "paris", "unit": "celsius"}'), name,
                              constraint=grammar.new_constraint(), stop_token_ids=eos)
                for name in (None, "upper")]
        seqs += [runner.submit(runner.prompt(m), "title") for m in MESSAGES]
        runner.wait(seqs)
        outputs[runner is spec] = [s.output for s in seqs]
        assert all(s.constraint.error is None for s in seqs[:2])
    assert outputs[True] == outputs[False]


def test_a_follow_up_turn_reuses_the_prompt_cache_after_speculation(echo, echo_refs):
    """A row that ends after a speculative step lacks the KV state of its
    last token; the prompt cache stores the rest, and the next turn reuses it
    and answers as plain mlx-lm does."""
    spec, _, base, _ = echo
    first = spec.prompt(MESSAGES[2])
    out = spec.run(first, None, max_tokens=20)
    assert out == echo_refs[None, 1.0, MESSAGES[2]][:20]
    follow = first + out + spec.prompt("and once more")
    seq = spec.submit(follow, None, max_tokens=30)
    spec.wait([seq])
    assert seq.num_cached_tokens >= len(first)
    model, _ = merged_model(base)
    assert seq.output == greedy_tokens(model, follow, 30)


def test_abort_during_speculation_frees_the_row(echo, echo_refs):
    spec, _, _, _ = echo
    long = spec.submit(spec.prompt(MESSAGES[1] * 3), None, max_tokens=2000)
    short = spec.submit(spec.prompt(MESSAGES[0]), "upper")
    spec.wait_decoding([long])
    spec.engine.abort(long.seq_id)
    spec.wait([long, short])
    assert long.finish_reason == "abort" and len(long.output) < 2000
    assert short.output == echo_refs["upper", 1.0, MESSAGES[0]]


def test_batches_above_the_cut_off_do_not_speculate(echo_demo):
    base, _ = echo_demo
    r = Runner(base, max_tokens=12, speculative=SpeculativeConfig(max_batch=2, cost_aware=False))
    try:
        r.wait([r.submit(r.prompt(m)) for m in MESSAGES])  # four rows: over the cut-off
        assert runner_stats(r.engine).spec_steps == 0
        r.run(r.prompt(MESSAGES[1]))
        assert runner_stats(r.engine).spec_steps > 0
    finally:
        r.stop()


# ---- a draft model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafted(tiny_model, adapters):
    """The tiny model drafting for itself: bare, its greedy drafts are all
    right for the base and partly right under an adapter."""
    cfg = SpeculativeConfig(method="draft", draft_model=str(tiny_model), **WIDE)
    spec = Runner(tiny_model, adapters=list(adapters.items()), max_tokens=16, speculative=cfg,
                  draft_model=tiny_model)
    plain = Runner(tiny_model, adapters=list(adapters.items()), max_tokens=16)
    yield spec, plain
    spec.stop()
    plain.stop()


def test_draft_model_greedy_equals_merged_mlx_lm_in_a_mixed_batch(drafted, tiny_model, adapters):
    spec, _ = drafted
    questions = ["Hello there", "What is the capital of France?", "Write a poem about autumn"]
    refs = {}
    for name in (None, *adapters):
        model, _ = merged_model(tiny_model, [adapters[name]] if name else [])
        for q in questions:
            refs[name, q] = greedy_tokens(model, spec.prompt(q), 16)
    jobs = list(refs)
    seqs = [spec.submit(spec.prompt(q), name) for name, q in jobs]
    assert spec.wait(seqs) == [refs[j] for j in jobs]
    st = runner_stats(spec.engine)
    assert st.spec_steps > 0 and 0 < st.accepted_tokens < st.draft_tokens


def test_draft_model_sampling_penalties_and_logprobs_equal_plain_decoding(drafted):
    spec, plain = drafted
    questions = ["Hello there", "Tell me a story about the sea"]
    for p in [dict(temperature=1.0, seed=3), dict(temperature=0.7, top_p=0.8, seed=9, logprobs=2),
              dict(frequency_penalty=0.5, presence_penalty=0.5), dict(logit_bias=((17, 4.0),))]:
        a = [spec.submit(spec.prompt(q), n, **p) for q in questions for n in (None, "a", "c")]
        b = [plain.submit(plain.prompt(q), n, **p) for q in questions for n in (None, "a", "c")]
        assert spec.wait(a) == plain.wait(b), p


def test_a_draft_model_with_another_tokenizer_is_refused_naming_both(tiny_model, tmp_path):
    other = make_tiny_model(tmp_path / "other", TinyModelSpec(vocab_size=300))
    target = load_base_model(str(tiny_model))
    with pytest.raises(ModelLoadError) as e:
        load_draft_model(str(other), target)
    assert str(other) in e.value.message and str(tiny_model) in e.value.message
