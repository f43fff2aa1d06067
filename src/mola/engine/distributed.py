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
from dataclasses import asdict

import mlx.core as mx

from .prompt_cache import PrefixHit
from .scheduler import StepPlan
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
    return (seq.seq_id, seq.prompt, seq.slot, seq.lora_scale, asdict(seq.params), grammar)


def wire_plan(plan: StepPlan) -> dict:
    """A StepPlan as plain data: new sequences in full, known ones by id."""
    return {
        "keep": plan.keep,
        "group": [_spec(s) if plan.group_is_new else s.seq_id for s in plan.group],
        "new": plan.group_is_new,
        "start": plan.start,
        "end": plan.end,
        "join": plan.join,
        "decode": [s.seq_id for s in plan.decode],
        # the prompt cache's orders: entry ids and token counts only
        "store_rows": plan.store_rows,
        "hits": [None if h is None else (h.entry, h.num_tokens) for h in plan.hits],
        "store_joined": plan.store_joined,
        "evict": plan.evict,
        # speculation: per row, tokens drafted, and prompt lookup's drafts
        "num_draft": plan.num_draft,
        "draft_tokens": plan.draft_tokens,
    }


def unwire_plan(data: dict, seqs: dict[int, Sequence], rebuild=None) -> StepPlan:
    """The StepPlan rank 0 ran, with this rank's own Sequence objects (and
    their own matchers, ``rebuild(grammar)``: every rank samples the same
    tokens, so every rank's matchers stay in step)."""
    if data["new"]:
        group = []
        for seq_id, prompt, slot, scale, params, grammar in data["group"]:
            seq = Sequence(prompt=prompt, params=SamplingParams(**params), slot=slot,
                           lora_scale=scale, seq_id=seq_id, status=SequenceStatus.PREFILLING,
                           constraint=rebuild(grammar) if grammar is not None else None)
            seqs[seq_id] = seq
            group.append(seq)
    else:
        group = [seqs[i] for i in data["group"]]
    plan = StepPlan(keep=data["keep"], group=group, group_is_new=data["new"], start=data["start"],
                    end=data["end"], join=data["join"], decode=[seqs[i] for i in data["decode"]],
                    store_rows=data["store_rows"], store_joined=data["store_joined"], evict=data["evict"],
                    hits=[None if h is None else PrefixHit(*h) for h in data["hits"]],
                    num_draft=data["num_draft"], draft_tokens=data["draft_tokens"])
    alive = set(data["decode"]) | {s.seq_id for s in group}
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
    from ..lora.pack import AdapterPacks
    from ..lora.recipe import read_recipe
    from .runner import ModelRunner

    stream = mx.new_stream(mx.default_device())
    try:
        with mx.stream(stream):
            loaded = loader()
            packs = AdapterPacks.install(loaded.model, max_loras=config.max_loras,
                                         max_rank=config.max_lora_rank)
            # The same one-token probe as rank 0's runner (its collectives pair up).
            runner = ModelRunner(loaded.model, packs, loaded.vocab_size,
                                 prompt_cache=config.prompt_cache_bytes > 0, draft=loaded.draft)
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
                    packs.fill_from(slot, read_recipe(recipe, packs.geometry, loaded.config), recipe.scale)
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
