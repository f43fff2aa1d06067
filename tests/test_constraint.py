"""Constrained rows in the engine's batch (mola/engine/constraint.py, the
runner's masked sampling): at temperature 0 a constrained row equals a naive
per-row loop over plain mlx-lm (merged weights for an adapter) that masks
with llguidance's own byte mask; alone or in a batch mixed with free rows,
other grammars and other adapters; seeded sampling too; aborts and
max_tokens leave valid prefixes."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mola.structured import Grammar, StructuredOutputs

from helpers.engines import runner_stats
from helpers.references import detokenize, merged_model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "pet": {"enum": ["cat", "dog", None]}, "tags": {"type": "array", "items": {"type": "boolean"},
                                                                  "maxItems": 3}},
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
CHOICE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
QUESTIONS = ["Hello there", "Who are you? Tell me everything.", "hi", "A list of facts about the sea"]
MAX_TOKENS = 40


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def grammars(runner):
    s = StructuredOutputs(runner.loaded.tokenizer, runner.loaded.vocab_size)
    return {"person": s.for_request(response_format=fmt(PERSON)),
            "choice": s.for_request(response_format=fmt(CHOICE)),
            "object": s.for_request(response_format={"type": "json_object"}),
            # 3000 items at least: rows under it run until they are aborted
            "endless": s.compile(Grammar('start: "[" /(a, ){3000}/ "]"\n', "long", "test"))}


def eos(runner):
    return frozenset(runner.loaded.tokenizer.eos_token_ids)


def naive_constrained(model, prompt, compiled, max_tokens, eos_ids):
    """One row, step by step: plain mlx-lm logits, every token outside
    llguidance's byte mask (compute_logit_bias) set to -inf in numpy, argmax."""
    matcher = compiled.matcher.deep_copy()
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(max_tokens):
        raw = np.array(logits.astype(mx.float32))
        allowed = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[: raw.shape[0]] > 0
        token = int(np.argmax(np.where(allowed, raw, -np.inf)))
        out.append(token)
        if token in eos_ids:
            break
        assert matcher.consume_token(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def check_output(runner, seq, schema):
    """finish 'stop': the text parses and fits the schema; 'length': a prefix
    the grammar still accepts."""
    text = detokenize(runner.loaded.tokenizer, seq.output)
    if seq.finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert seq.finish_reason == "length", seq.finish_reason
        assert seq.constraint.error is None and not seq.constraint.matcher.is_error()
    return text


def test_constrained_rows_match_a_naive_masked_loop_in_a_mixed_batch(runner, grammars, tiny_model, adapters):
    jobs = [(q, name, g) for q in QUESTIONS for name, g in ((None, "person"), ("a", "choice"), ("c", "object"))]
    # Free rows of every adapter share the batch.
    free = [runner.submit(runner.prompt(q), n) for q in QUESTIONS for n in (None, "b")]
    seqs = [runner.submit(runner.prompt(q), name, constraint=grammars[g].new_constraint(), stop_token_ids=eos(runner))
            for q, name, g in jobs]
    runner.wait(seqs + free)
    models = {n: merged_model(tiny_model, [adapters[n]] if n else [])[0] for n in (None, "a", "c")}
    finishes = set()
    for (q, name, g), seq in zip(jobs, seqs):
        ref = naive_constrained(models[name], runner.prompt(q), grammars[g], MAX_TOKENS, eos(runner))
        assert seq.output == ref, (q, name, g)
        check_output(runner, seq, {"person": PERSON, "choice": CHOICE, "object": {"type": "object"}}[g])
        finishes.add(seq.finish_reason)
    assert "stop" in finishes  # some finish inside the budget and parse
    # The free rows are what they are alone.
    for q, seq in zip([q for q in QUESTIONS for _ in (None, "b")], free):
        assert seq.output == runner.run(runner.prompt(q), seq.slot and "b" or None)


def test_seeded_constrained_sampling_does_not_depend_on_the_batch(runner, grammars):
    prompt = runner.prompt(QUESTIONS[1])
    params = dict(temperature=1.0, seed=7, stop_token_ids=eos(runner))
    alone = runner.wait([runner.submit(prompt, "b", constraint=grammars["person"].new_constraint(), **params)])[0]
    crowd = [runner.submit(runner.prompt(q), n, constraint=grammars["choice"].new_constraint() if i % 2 else None,
                           temperature=1.0, stop_token_ids=eos(runner))
             for i, (q, n) in enumerate((q, n) for q in QUESTIONS for n in (None, "a", "c"))]
    mine = runner.submit(prompt, "b", constraint=grammars["person"].new_constraint(), **params)
    runner.wait(crowd + [mine])
    assert mine.output == alone
    check_output(runner, mine, PERSON)
    for seq in crowd:
        if seq.constraint is not None:
            check_output(runner, seq, CHOICE)


def test_each_choice_has_its_own_matcher(runner, grammars):
    """n > 1: the same grammar, different seeds, different valid outputs."""
    prompt = runner.prompt(QUESTIONS[0])
    seqs = [runner.submit(prompt, None, constraint=grammars["person"].new_constraint(), temperature=1.0, seed=s,
                          stop_token_ids=eos(runner)) for s in range(4)]
    runner.wait(seqs)
    texts = {check_output(runner, s, PERSON) for s in seqs}
    assert len(texts) > 1


def test_max_tokens_and_abort_leave_valid_prefixes(runner, grammars):
    """A matcher consumes exactly the tokens the engine accepts, also while
    other constrained rows keep the batch masked after its row ended."""
    prompt = runner.prompt(QUESTIONS[3])

    def endless(adapter=None):
        return runner.submit(prompt, adapter, constraint=grammars["endless"].new_constraint(), max_tokens=10_000,
                             stop_token_ids=eos(runner), temperature=1.0, seed=3)

    companion = endless("c")
    short = runner.submit(prompt, "a", constraint=grammars["object"].new_constraint(), max_tokens=3, stop_token_ids=eos(runner))
    long = endless()
    runner.wait([short])
    assert short.finish_reason == "length" and len(short.output) == 3
    runner.engine.abort(long.seq_id)
    runner.wait([long])
    assert not companion.is_finished  # the steps after both ended were masked
    runner.engine.abort(companion.seq_id)
    runner.wait([companion])
    for seq in (short, long, companion):
        assert seq.constraint.num_tokens == len(seq.output), seq.finish_reason
        assert not seq.constraint.matcher.is_error()
    assert long.finish_reason == "abort" and companion.finish_reason == "abort"


def test_steps_without_a_constrained_row_are_not_masked(runner, grammars):
    before = runner_stats(runner.engine).masked_steps
    runner.wait([runner.submit(runner.prompt(q), "a") for q in QUESTIONS])
    assert runner_stats(runner.engine).masked_steps == before
    runner.wait([runner.submit(runner.prompt(QUESTIONS[0]), None, constraint=grammars["choice"].new_constraint(),
                               stop_token_ids=eos(runner))])
    assert runner_stats(runner.engine).masked_steps > before
