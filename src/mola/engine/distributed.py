"""Serving one base model sharded over several processes (mx.distributed).

Started by ``mlx.launch ... -- mola serve --distributed``: every rank loads
its tensor-parallel shard of the base with mlx-lm's own sharding; rank 0 runs
the HTTP server, the registry and the scheduler. Before each thing rank 0's
engine does to the model -- a step of the batch, an adapter written into or
cleared from a slot -- it sends every other rank a message saying exactly
that, over mx.distributed itself (pickled, through an all-sum, as mlx-lm's
server shares requests). The other ranks (followers) replay the messages in
order, so every rank runs the same forward passes, whose collectives keep
them in lockstep, and no step ever mixes adapter versions.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import asdict, fields

import mlx.core as mx

from .plan import StepPlan
from .sequence import SamplingParams, Sequence, SequenceStatus

log = logging.getLogger("mola.distributed")

HEARTBEAT_SECONDS = 2.0  # an idle rank 0 checks its followers this often
SHARE_TIMEOUT_SECONDS = 10.0  # a rank that takes longer to hear rank 0 counts as lost


class Group:
    """A tensor-parallel group, and the one way rank 0 talks to the others."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, message=None):
        """Rank 0's ``message``, on every rank (others pass nothing)."""
        if self.is_leader:
            data = mx.array(bytearray(pickle.dumps(message)), dtype=mx.uint8)
            mx.eval(mx.distributed.all_sum(mx.array(data.size), group=self.group))
            mx.eval(mx.distributed.all_sum(data, group=self.group))
            return message
        size = mx.distributed.all_sum(mx.array(0), group=self.group).item()
        data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group)
        return pickle.loads(bytes(memoryview(data)))


class Leader:
    """Rank 0's side of a group: it tells the other ranks each thing it does
    to the model, and notices when they stop answering. Without a group,
    telling does nothing."""

    def __init__(self, group: Group | None):
        self.group = group
        # When rank 0 began telling the group its next action (None: not now).
        # The message is small and every rank answers between two steps, so a
        # share that outlasts SHARE_TIMEOUT_SECONDS means a rank is gone or
        # stuck, whether or not the collective backend ever reports it.
        self._sharing_since: float | None = None

    @property
    def stalled(self) -> bool:
        since = self._sharing_since
        return since is not None and time.monotonic() - since > SHARE_TIMEOUT_SECONDS

    def tell(self, message) -> None:
        if self.group is None:
            return
        self._sharing_since = time.monotonic()
        try:
            self.group.share(message)
        finally:
            self._sharing_since = None


# ---- plans on the wire -------------------------------------------------------------


def _spec(seq: Sequence) -> tuple:
    grammar = seq.constraint.grammar if seq.constraint is not None else None
    # A preempted sequence comes back with its output so far and its PRNG key.
    return (seq.seq_id, seq.prompt, seq.slot, seq.lora_scale, asdict(seq.params), grammar, seq.output,
            seq.resume_key, seq.adapter_start)


def _follow(spec: tuple, rebuild) -> Sequence:
    """A follower's own Sequence for one that rank 0 starts to prefill."""
    seq_id, prompt, slot, scale, params, grammar, output, resume_key, adapter_start = spec
    constraint = rebuild(grammar) if grammar is not None else None
    for token in output if constraint is not None else ():
        constraint.advance(token)
    seq = Sequence(prompt=prompt, params=SamplingParams(**params), slot=slot, lora_scale=scale, seq_id=seq_id,
                   constraint=constraint, output=list(output), adapter_start=adapter_start)
    seq.resume_key = resume_key
    seq.move_to(SequenceStatus.PREFILLING)
    return seq


def wire_plan(plan: StepPlan) -> dict:
    """A StepPlan as picklable data: each of its fields as it is (the cache
    orders and the proposal are plain dataclasses), but its sequences, which
    go by id (the prefill batch's in full when it is new)."""
    data = {f.name: getattr(plan, f.name) for f in fields(plan)}
    data["prefill"] = [_spec(s) if plan.prefill_is_new else s.seq_id for s in plan.prefill]
    data["decode"] = [s.seq_id for s in plan.decode]
    data["preempted"] = [(row, s.seq_id) for row, s in plan.preempted]
    return data


def unwire_plan(data: dict, seqs: dict[int, Sequence], rebuild=None) -> StepPlan:
    """The StepPlan rank 0 ran, with this rank's own Sequence objects (and
    their own matchers, ``rebuild(grammar)``: every rank samples the same
    tokens, so every rank's matchers stay in step)."""
    if data["prefill_is_new"]:
        prefill = [_follow(spec, rebuild) for spec in data["prefill"]]
        seqs.update((s.seq_id, s) for s in prefill)
    else:
        prefill = [seqs[i] for i in data["prefill"]]
    plan = StepPlan(**{**data, "prefill": prefill, "decode": [seqs[i] for i in data["decode"]],
                       "preempted": [(row, seqs[i]) for row, i in data["preempted"]]})
    alive = set(data["decode"]) | {s.seq_id for s in prefill}
    for seq_id in list(seqs):
        if seq_id not in alive:
            del seqs[seq_id]
    return plan


# ---- the other ranks ---------------------------------------------------------------


def run_follower(loader, config, group: Group, grammars=None) -> int:
    """A rank other than 0: load the shard, then replay rank 0's messages
    until it says stop (or the group breaks). Adapters are re-created from
    the recipe rank 0 wrote, read and checked the way rank 0 did; the
    matchers of constrained rows from their grammar text, with
    ``grammars(loaded)`` (grammar text -> Constraint). Speculative steps
    come with rank 0's drafts (prompt lookup) or are drafted by this rank's
    own whole copy of the draft model (``loaded.draft``): every rank
    verifies the same drafts alike."""
    from ..adapters.recipe import read_recipe
    from ..lora.pack import AdapterPacks
    from .runner import ModelRunner

    stream = mx.new_stream(mx.default_device())
    try:
        with mx.stream(stream):
            loaded = loader()
            packs = AdapterPacks.install(loaded.model, max_loras=config.max_loras,
                                         max_rank=config.max_lora_rank)
            # The same one-token probe as rank 0's runner (its collectives pair up).
            runner = ModelRunner(loaded.model, packs, loaded.vocab_size, prompt_cache=config.prompt_cache_bytes > 0,
                                 draft=loaded.draft, kv_quant=config.kv_quant)
            rebuild = grammars(loaded) if grammars is not None else None
            seqs: dict[int, Sequence] = {}
            log.info("rank %d of %d ready", group.rank, group.size)
            while True:
                message = group.share()
                kind = message[0]
                if kind == "stop":
                    return 0
                if kind == "step":
                    runner.run(unwire_plan(message[1], seqs, rebuild))
                elif kind == "write":
                    _, slot, recipe = message
                    packs.fill_from(slot, read_recipe(recipe, packs.geometry, loaded.config), recipe.slot_scale)
                elif kind == "clear":
                    packs.empty(message[1])
                elif kind == "forget":  # rank 0's prompt cache dropped these entries
                    runner.kv.drop(message[1])
    except Exception:
        log.exception("rank %d stops: the group broke or a step failed", group.rank)
        return 1
    finally:
        mx.synchronize(stream)
        mx.clear_streams()
