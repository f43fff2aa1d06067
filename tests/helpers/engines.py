"""An engine without the server: EngineRunner, the registry on an engine, and the gate that makes a batch."""

from __future__ import annotations

import asyncio
import threading
import time
from mola.engine.engine import Engine
from mola.models.loader import load_base_model
from mola.adapters.formats import read_adapter


# Prompts of several lengths for the engine's and the runner's tests, and
# their answers' length.
ENGINE_QUESTIONS = [
    "Hello there",
    "What is the capital of France? Please answer in one word.",
    "hi",
    "Write a poem about autumn leaves falling softly on the quiet street, then explain it.",
]


ENGINE_MAX_TOKENS = 10


def run_registry(engine, scenario, max_loras: int = 1, **registry_args) -> None:
    """Run ``scenario(registry)`` (async, bounded at 60 s) on a fresh registry
    of ``max_loras`` slots whose loader writes into ``engine``."""
    from mola.adapters.loader import AdapterLoader
    from mola.engine.async_engine import AsyncEngine
    from mola.registry.registry import AdapterRegistry

    async def main():
        loader = AdapterLoader(AsyncEngine(engine), engine.loaded.config)
        registry = AdapterRegistry("tiny", loader, max_loras, **registry_args)
        try:
            await asyncio.wait_for(scenario(registry), timeout=60)
        finally:
            registry.close()
            loader.close()
    asyncio.run(main())


def runner_stats(engine):
    """A copy of the runner's counters, taken on the engine thread (the only
    thread that may read the runner)."""
    import dataclasses

    return engine.call(lambda: dataclasses.replace(engine.runner.stats)).result(timeout=30)


def num_unfinished(engine) -> int:
    """Sequences the scheduler holds, counted on the engine thread."""
    return engine.call(lambda: engine.scheduler.num_unfinished).result(timeout=30)


class EngineRunner:
    """A real engine on a model directory, adapters in slots, and a blocking
    way to run sequences to the end."""

    def __init__(self, model_dir, adapters=(), max_tokens: int = 10, draft_model=None, dtype: str = "auto", **config):
        from mola.engine.engine import EngineConfig
        from mola.models.loader import load_draft_model

        def load():
            loaded = load_base_model(str(model_dir), dtype=dtype)
            if draft_model is not None:  # as mola serve --draft-model loads it
                loaded.draft = load_draft_model(str(draft_model), loaded).model
            return loaded

        self.max_tokens = max_tokens
        self.done: dict = {}
        self.num_tokens: dict[int, int] = {}  # seq_id -> tokens generated so far
        self.logprobs: dict = {}  # seq_id -> [(logprob, [(id, logprob)])], for rows that ask
        self.cond = threading.Condition()
        self.engine = Engine(
            load,
            EngineConfig(**{"max_loras": 4, "max_lora_rank": 16, **config}),
            self._on_outputs,
        )
        self.loaded = self.engine.start()
        self.slots: dict[str, int] = {}
        self.versions: dict[str, int] = {}
        for name, path in adapters:
            self.add(name, self.read(path))

    def read(self, path):
        """The adapter at ``path`` as the server reads it (with the base's config)."""
        config = self.loaded.config
        return read_adapter(path, dtype=self.engine.geometry.dtype, model_type=config.get("model_type"),
                            model_config=config)

    def add(self, name: str, weights) -> None:
        """Validate ``weights`` (LoRAWeights) and write them into the next slot."""
        from mola.adapters.weights import validate

        geometry = self.engine.geometry
        validate(weights, geometry.targets, geometry.max_rank, geometry.max_expert_rank)
        slot = self.slots.get(name, len(self.slots) + 1)
        self.engine.call(lambda: self.engine.packs.fill_from(slot, weights)).result()
        self.slots[name] = slot
        self.versions[name] = self.versions.get(name, 0) + 1  # the prompt cache's key changes

    def _on_outputs(self, outputs):
        with self.cond:
            for out in outputs:
                self.num_tokens[out.seq_id] = self.num_tokens.get(out.seq_id, 0) + len(out.tokens)
                if out.logprobs:
                    self.logprobs.setdefault(out.seq_id, []).extend(out.logprobs)
                if out.finish_reason is not None:
                    self.done[out.seq_id] = out
            self.cond.notify_all()

    def submit(self, prompt, adapter=None, lora_scale=1.0, constraint=None, adapter_start=None, vision=None,
               **params):
        from mola.engine.sequence import SamplingParams, Sequence

        params = {"max_tokens": self.max_tokens, "temperature": 0.0, **params}
        key = None if adapter is None else (adapter, self.versions[adapter])  # as Lease.key
        seq = Sequence(prompt=list(prompt), params=SamplingParams(**params), slot=self.slots.get(adapter, 0),
                       lora_scale=lora_scale, adapter_key=key, constraint=constraint, adapter_start=adapter_start,
                       vision=vision)
        self.engine.add(seq)
        return seq

    def wait(self, seqs, timeout=60):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(s.seq_id in self.done for s in seqs):
                assert self.cond.wait(deadline - time.monotonic()), "engine timed out"
        return [s.output for s in seqs]

    def wait_decoding(self, seqs, timeout=60):
        """Wait until each of ``seqs`` has generated a token (it is in the
        decode batch), told by the engine's outputs."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(self.num_tokens.get(s.seq_id) for s in seqs):
                assert self.cond.wait(deadline - time.monotonic()), "engine timed out"

    def run(self, prompt, adapter=None, **params):
        return self.wait([self.submit(prompt, adapter, **params)])[0]

    def prompt(self, question):
        return self.loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )

    def stop(self):
        self.engine.stop()


def together(runner: EngineRunner, submit):
    """``submit()`` while the engine thread waits on a gate: it takes every
    sequence before its next step, so the schedule (who runs with whom, who
    is preempted) is the same every run."""
    gate = threading.Event()
    runner.engine.call(gate.wait)
    try:
        return submit()
    finally:
        gate.set()


def hold_packs_at_ceilings(packs) -> None:
    """Size ``packs`` (an AdapterPacks) as they were at start before they
    followed the loads, every layer at every slot and the largest rank, and
    keep them so: the reference that packs sized to what is loaded must match."""
    for layer in packs.layers.values():
        if hasattr(layer, "slot_capacity"):
            layer.resize(packs.num_slots, packs.max_rank)
        else:
            layer.resize(packs.max_expert_rank)
    packs._slot_capacity = packs.num_slots  # writes find every pack large enough already
    packs._shrink = lambda lazy: None  # and nothing ever shrinks (nor waits to)
    packs.__class__ = type("PacksAtCeilings", (type(packs),), {"is_oversized": property(lambda self: False)})


def write_slot(runner: EngineRunner, slot: int, weights) -> None:
    """Queue ``weights`` into ``slot`` through the engine's own slot write (as
    the registry does), without waiting for it."""
    from mola.adapters.weights import validate
    from mola.lora.pack import prepare_rows

    geometry = runner.engine.geometry
    validate(weights, geometry.targets, geometry.max_rank, geometry.max_expert_rank)
    rows = prepare_rows(weights, geometry)
    runner.engine.call(lambda: runner.engine.write_slot(slot, rows, None))
