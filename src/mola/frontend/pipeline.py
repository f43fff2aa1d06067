"""The request pipeline: a :class:`GenerationSpec` in, one
:class:`Generation` per (prompt, choice) out, running on the engine.

    admit (cheap checks, backpressure)  ->  images decoded (a worker thread)  ->  prepare (one tokenizer trip)
    ->  leases on the model id  ->  sequences handed to the engine

No HTTP here: the server's dialects make the spec and turn the generations
into their responses."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from ..adapters.weights import invocation_start
from ..engine.sequence import Sequence
from ..errors import RequestTimedOut
from ..registry.registry import Lease
from .admit import Admitted, accept, admit, check_constrainable, sampling_params
from .generation import Generation
from .prepare import Prepared, prepare, with_images
from .spec import GenerationSpec
from .state import ServerState


async def start(state: ServerState, spec: GenerationSpec) -> list[Generation]:
    """Admit ``spec``, decode its images, prepare it in one tokenizer trip,
    and hand its sequences to the engine."""
    admitted = admit(state, spec)
    spec = dataclasses.replace(spec, prompt=await with_images(state, spec.prompt, spec.model))
    prepared = await prepare(state, spec)
    check_constrainable(spec.sampling, prepared.grammar)
    accept(state, len(prepared.prompts) * spec.n)  # again: others may have been admitted meanwhile
    return await launch(state, spec, admitted, prepared)


async def launch(state: ServerState, spec: GenerationSpec, admitted: Admitted,
                 prepared: Prepared) -> list[Generation]:
    """One Generation per (prompt, choice), each with its own lease (and,
    under a grammar, its own matcher; with reasoning, its own parser of the
    thinking)."""
    timeout = state.config.request_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    params = [[sampling_params(state, spec, admitted, len(p), j) for j in range(spec.n)] for p in prepared.prompts]
    gens: list[Generation] = []
    try:
        for i, prompt in enumerate(prepared.prompts):
            for j in range(spec.n):
                lease = await _acquire(state, spec, deadline)
                gens.append(_generation(state, spec, prepared, lease, prompt, params[i][j], deadline,
                                        i * spec.n + j))
    except BaseException:
        for g in gens:
            g.close()
        raise
    return gens


def _generation(state: ServerState, spec: GenerationSpec, prepared: Prepared, lease: Lease, prompt: list[int],
                params, deadline: float | None, index: int) -> Generation:
    invocation = lease.record.invocation_tokens if lease.record is not None else None
    start = invocation_start(invocation, prompt) if invocation else None
    plain = invocation is None or start is not None  # else: not invoked, the base alone
    grammar = prepared.grammar
    seq = Sequence(prompt=list(prompt), params=params, slot=lease.slot if plain else 0,
                   lora_scale=lease.row_scale if plain else 1.0, adapter_key=lease.key if plain else None,
                   deadline=deadline, constraint=grammar.new_constraint() if grammar else None,
                   adapter_start=start, vision=prepared.vision)
    gen = Generation(state, seq, lease, list(spec.sampling.stop), index=index, tools=spec.tools, model=spec.model,
                     skip_special_tokens=spec.sampling.skip_special_tokens, reasoning=prepared.reasoning,
                     json_calls=grammar.grammar.json_calls if grammar else None)
    gen.alora_invoked = None if invocation is None else start is not None
    return gen


async def _acquire(state: ServerState, spec: GenerationSpec, deadline: float | None) -> Lease:
    """A lease on the request's model id; waiting for an adapter slot counts
    against --request-timeout like waiting in the engine's queue."""
    acquire = state.registry.acquire(spec.model, spec.lora_scale, list(spec.adapters) if spec.adapters else None)
    if deadline is None:
        return await acquire
    try:
        return await asyncio.wait_for(acquire, timeout=max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise RequestTimedOut(
            f"The request waited longer than --request-timeout ({state.config.request_timeout:g} s) "
            "for an adapter slot; try again later."
        ) from None
