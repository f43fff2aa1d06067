"""Admission: what a request may ask, decided before any tokenizer work
(backpressure, the vocabulary), and once its prompts are counted, what it
may generate (the context length, the KV budget)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sequence import SamplingParams
from ..errors import ContextLengthExceeded, InvalidRequest, KVBudgetExceeded, Overloaded, ShuttingDown
from ..structured import CompiledGrammar
from .spec import GenerationSpec, SamplingSpec
from .state import ServerState


@dataclass(frozen=True)
class Admitted:
    """What admission checked of a spec's sampling: ids within the vocabulary."""

    stop_token_ids: frozenset[int]
    logit_bias: tuple[tuple[int, float], ...]


def admit(state: ServerState, spec: GenerationSpec) -> Admitted:
    """The cheap checks, before any tokenizer work: backpressure, then the
    token ids the request names."""
    accept(state, spec.num_prompts * spec.n)
    sampling = spec.sampling
    for token in sampling.stop_token_ids:
        if token >= state.vocab_size:
            raise InvalidRequest(f"stop_token_ids names token {token}, outside the vocabulary (size "
                                 f"{state.vocab_size}).", param="stop_token_ids")
    bias = tuple((int(k), float(v)) for k, v in (sampling.logit_bias or {}).items())
    for token, _ in bias:
        if token >= state.vocab_size:
            raise InvalidRequest(f"logit_bias names token {token}, outside the vocabulary (size "
                                 f"{state.vocab_size}).", param="logit_bias")
    return Admitted(frozenset(sampling.stop_token_ids), bias)


def accept(state: ServerState, num_sequences: int) -> None:
    """Backpressure: refuse new work while shutting down, or when the queue is full."""
    if state.draining:
        state.metrics.rejected.labels("shutdown").inc()
        raise ShuttingDown("The server is shutting down and takes no new requests.")
    would_queue = state.active_sequences + num_sequences - state.config.engine.max_num_seqs
    if would_queue > state.config.max_queue:
        state.metrics.rejected.labels("queue_full").inc()
        raise Overloaded(
            f"The server is at capacity: {state.active_sequences} sequences are running or "
            f"queued (--max-num-seqs {state.config.engine.max_num_seqs}, --max-queue "
            f"{state.config.max_queue}); retry later.", retry_after=1,
        )


def check_constrainable(sampling: SamplingSpec, grammar: CompiledGrammar | None) -> None:
    """What a grammar cannot be combined with: a stop string would cut the
    output short of the grammar, and ignore_eos would run past its end."""
    if grammar is None:
        return
    what = grammar.grammar.param
    if sampling.stop:
        raise InvalidRequest(f"'stop' cannot be combined with {what}: a stop string would cut "
                             "the constrained output before it is complete.", param="stop")
    if sampling.ignore_eos:
        raise InvalidRequest(f"'ignore_eos' cannot be combined with {what}: the output ends "
                             "where its grammar does.", param="ignore_eos")


def max_tokens_for(state: ServerState, spec: GenerationSpec, num_prompt_tokens: int) -> int:
    """What a prompt of ``num_prompt_tokens`` may generate: the request's
    max_tokens if the context and the KV budget hold it, else a 400."""
    limit, what = state.max_model_len, spec.prompt.param
    requested, param = spec.sampling.max_tokens, spec.sampling.max_tokens_param
    if limit is not None:
        if num_prompt_tokens >= limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{what} resulted in {num_prompt_tokens} tokens.", param=what)
        room = limit - num_prompt_tokens
        if requested is not None and requested > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in "
                f"the {what}, {requested} in the completion). Please reduce the length "
                f"of the {what} or completion.", param=param)
        max_tokens = requested if requested is not None else room
    else:
        max_tokens = requested if requested is not None else state.config.default_max_tokens
    budget = state.kv_budget
    if budget is not None and budget.refusal(num_prompt_tokens, max_tokens) is not None:
        if requested is None and budget.max_tokens_for(num_prompt_tokens) >= 1:
            return budget.max_tokens_for(num_prompt_tokens)  # what the budget can give it alone
        raise KVBudgetExceeded(budget.refusal(num_prompt_tokens, max_tokens),
                               param=param if requested is not None else what)
    return max_tokens


def sampling_params(state: ServerState, spec: GenerationSpec, admitted: Admitted, num_prompt_tokens: int,
                    choice: int = 0) -> SamplingParams:
    s = spec.sampling
    return SamplingParams(
        max_tokens=max_tokens_for(state, spec, num_prompt_tokens),
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        # Choice i of a seeded request draws with seed + i: reproducible, distinct.
        seed=None if s.seed is None else s.seed + choice,
        # EOS (the model's end-of-generation set, models/eog.py) unless ignored; the request's own ids always.
        stop_token_ids=(frozenset() if s.ignore_eos else frozenset(state.tokenizer.eos_token_ids))
        | admitted.stop_token_ids,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        logit_bias=admitted.logit_bias,
        logprobs=s.logprobs,
    )
