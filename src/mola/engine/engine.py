"""The engine thread: it alone touches the model and its arrays.

MLX keeps streams per thread, so the model is loaded, adapters are written and
every forward pass runs on this one thread, on a stream it creates. Other
threads talk to it through a command queue (add, abort, call) and hear back
through ``on_outputs``, called once per step with every sequence's new tokens.

Each step is schedule -> run -> postprocess; nothing else lives there.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import random
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Callable

import mlx.core as mx

from ..adapters.recipe import SlotRecipe
from ..errors import EngineUnavailable
from ..lora.pack import AdapterPacks, PackStats, SlotGeometry, SlotRows, geometry_of
from ..models.model import LoadedModel
from .commands import Commands
from .config import EngineConfig
from .distributed import HEARTBEAT_SECONDS, SHARE_TIMEOUT_SECONDS, Group, Leader, wire_plan
from .kv_budget import KVBudget, make_kv_budget
from .memory import check_growth, check_slots_fit, free_bytes, gib
from .outputs import EngineSnapshot, KVStats, SeqOutput
from .vision_rows import check_vision_engine
from .plan import StepPlan, StepResult
from .prompt_cache import PromptCacheStats, make_prompt_cache
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import make_speculator

log = logging.getLogger("mola.engine")

# MLX needs every thread's streams cleared before the process exits, the main
# thread's included (importing mlx-lm creates a stream in the importing
# thread); without this the process may abort at exit.
atexit.register(mx.clear_streams)


class Engine:
    def __init__(
        self,
        loader: Callable[[], LoadedModel],
        config: EngineConfig = EngineConfig(),
        on_outputs: Callable[[list[SeqOutput]], None] | None = None,
        group: Group | None = None,
    ):
        self.config = config
        self.group = group  # a tensor-parallel group this engine leads, if any
        self.on_outputs = on_outputs or (lambda outputs: None)
        self._loader = loader
        self._commands = Commands()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._rng = random.Random()
        self.error: BaseException | None = None  # why the thread died
        self._seq_ids = itertools.count()  # numbers the sequences added (any thread: next() holds the GIL)
        self.scheduler: Scheduler | None = None  # engine thread only; made with the runner
        self.loaded: LoadedModel | None = None
        self.packs: AdapterPacks | None = None  # engine thread only
        self.runner: ModelRunner | None = None  # engine thread only
        self.geometry: SlotGeometry | None = None  # fixed once loaded: any thread may read it
        self.kv_budget: KVBudget | None = None  # fixed once loaded: any thread may read it
        self.snapshot = EngineSnapshot()  # replaced, never mutated, by the engine thread
        self.pack_stats = PackStats()  # replaced (never mutated) when the packs resize: any thread may read it
        self.num_steps = 0
        self._leader = Leader(group)  # tells the other ranks of a group what this one does

    # ---- lifecycle (any thread) -------------------------------------------

    def start(self, timeout: float | None = None) -> LoadedModel:
        """Start the thread and wait until the model is loaded."""
        self._thread = threading.Thread(target=self._main, name="mola-engine", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self.error is not None:
            raise self.error
        if self.loaded is None:
            raise TimeoutError("the engine did not finish loading the model in time")
        return self.loaded

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stopping = True
        self._commands.put(lambda: None)  # wake the loop
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.loaded is not None
            and self.error is None
            and not self.stalled
        )

    @property
    def stalled(self) -> bool:
        """A tensor-parallel group has not answered rank 0 in time (a lone engine never is)."""
        return self.group is not None and self._leader.stalled

    # ---- commands (any thread) --------------------------------------------

    def add(self, seq: Sequence) -> int:
        """Queue ``seq``, numbered now: returns its seq_id, by which its
        outputs come back and it is aborted."""
        self._check_alive()
        assert seq.seq_id is None, f"sequence {seq.seq_id} was added before"
        seq.seq_id = next(self._seq_ids)
        self._commands.put(lambda: self._add(seq))
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        if self.is_alive:
            self._commands.put(lambda: self._abort(seq_id))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine thread between two steps."""
        self._check_alive()
        return self._commands.call(fn, is_down=lambda: self.error is not None or self._stopping)

    def _check_alive(self) -> None:
        if not self.is_alive:
            reason = f": {self.error}" if self.error is not None else ""
            if self.stalled:
                reason = f": another rank of the group has not answered for over {SHARE_TIMEOUT_SECONDS:g} s"
            raise EngineUnavailable(f"The engine is not running{reason}")

    # ---- the thread --------------------------------------------------------

    def _main(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            try:
                self._load()
            except BaseException as e:
                self.error = e
                mx.synchronize(stream)
                mx.clear_streams()
                self._ready.set()
                return
            self._ready.set()
            try:
                self._loop()
            except BaseException as e:
                log.error("engine thread died:\n%s", traceback.format_exc())
                self.error = e
                self._fail_all(f"engine stopped: {e}")
            finally:
                # MLX needs a thread's streams cleared before the thread ends,
                # or the process may abort at exit.
                self.runner.reset()
                mx.synchronize(stream)
                mx.clear_streams()

    def _load(self) -> None:
        loaded = self._loader()
        c = self.config
        if loaded.takes_images:
            check_vision_engine(c, loaded.path)
        # Expert LoRA is not sharded: a tensor-parallel group serves none (distributed.py alike).
        expert_slots = c.expert_slots if self.group is None else 0
        slots = dict(max_loras=c.max_loras, max_rank=c.max_lora_rank, expert_slots=expert_slots,
                     max_expert_rank=c.max_expert_rank)
        check_slots_fit(geometry_of(loaded.model, c.max_lora_rank, c.max_loras + 1, expert_slots,
                                    c.max_expert_rank), free_bytes())
        self.packs = AdapterPacks.install(loaded.model, **slots)
        self.geometry = self.packs.geometry
        self.pack_stats = self.packs.stats()
        log.info("%s; they grow with the adapters loaded, up to %s at the ceilings (--max-loras %d, "
                 "--max-lora-rank %d)", self.pack_stats.summary(), gib(self.geometry.max_pack_bytes),
                 c.max_loras, c.max_lora_rank)
        self.runner = ModelRunner(loaded.model, self.packs, loaded.vocab_size, prompt_cache=c.prompt_cache_bytes > 0,
                             draft=loaded.draft, kv_quant=c.kv_quant)
        prompt_cache = make_prompt_cache(c.prompt_cache_bytes, self.runner.kv_cost,
                                         model_key=str(loaded.path or ""))
        self.kv_budget = make_kv_budget(c, self.runner.kv_position_bytes, loaded.max_model_len, free_bytes())
        self.scheduler = Scheduler(c.max_num_seqs, c.prefill_step_size, prompt_cache=prompt_cache,
                                   speculator=make_speculator(c.speculative, self.runner.can_rewind),
                                   budget=self.kv_budget)
        self.loaded = loaded
        self._publish()  # the budget and the empty batch show from the start, not after the first command

    def _has_work(self) -> bool:
        return self.scheduler.has_work() or self.runner.inflight is not None

    def _loop(self) -> None:
        idle_since = None  # when the engine last ran out of work
        while not self._stopping:
            if self._has_work():
                idle_since = None
            else:
                idle_since = time.monotonic() if idle_since is None else idle_since
                self._compact_packs(time.monotonic() - idle_since)
            self._drain_commands(block=not self._has_work(), idle_for=None if idle_since is None
                                 else time.monotonic() - idle_since)
            if self._stopping:
                break
            if self._has_work():
                self.step()
            self._publish()
        self._leader.tell(("stop",))
        self._fail_all("the server is shutting down")

    def _publish(self) -> None:
        s = self.scheduler
        cache = s.prompt_cache
        self.snapshot = EngineSnapshot(
            num_running=len(s.running), num_prefilling=len(s.prefilling), num_waiting=len(s.waiting),
            num_steps=self.num_steps, stats=replace(self.runner.stats),
            prompt_cache=cache.stats() if cache is not None else PromptCacheStats(),
            kv=self.kv_budget.stats(s.holding(), self.runner.stats.kv_bytes, s.num_preempted, s.num_kv_waits)
            if self.kv_budget else KVStats(held_bytes=self.runner.stats.kv_bytes),
        )

    def _compact_packs(self, idle_for: float) -> None:
        """Shrink the packs to what is loaded once idle long enough (pack_compact_idle_s)."""
        if idle_for >= self.config.pack_compact_idle_s and self.packs.compact():
            self._packs_changed(f"compacted after {idle_for:.1f} s idle")

    def _drain_commands(self, block: bool, idle_for: float | None = None) -> None:
        timeout = HEARTBEAT_SECONDS if self.group is not None else None
        if block and idle_for is not None and self.packs.is_oversized:  # wake to compact them
            left = max(0.0, self.config.pack_compact_idle_s - idle_for)
            timeout = left if timeout is None else min(timeout, left)
        if not self._commands.run(wait=block, timeout=timeout):
            if self.group is not None:
                self._leader.tell(("noop",))  # idle: make sure the other ranks are still there

    def step(self) -> None:
        plan = self.scheduler.schedule(time.monotonic())
        result = self._run(plan)
        self._emit(self.scheduler.postprocess(result))

    def _emit(self, outputs: list[SeqOutput]) -> None:
        if outputs:
            self.on_outputs(outputs)

    def _run(self, plan: StepPlan) -> StepResult | None:
        """Tell the group, then run the plan; a failed forward pass fails the
        batch's sequences (the engine goes on) unless a group is broken."""
        try:
            self._leader.tell(("step", wire_plan(plan)))
            result = self.runner.run(plan)
        except Exception as e:
            if self.group is not None:
                raise  # a broken group cannot take the next step: the engine stops
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_step(plan, f"{type(e).__name__}: {e}")
            return None
        self.num_steps += 1
        return result

    # ---- adapters in slots (engine thread; every rank in a group) ----------

    def write_slot(self, slot: int, rows: SlotRows, recipe: SlotRecipe) -> None:
        """Write prepared rows into ``slot`` (growing the packs where they
        need it); the other ranks of a group re-create them from ``recipe``
        at this point of the stream of steps."""
        self._leader.tell(("write", slot, recipe))
        resizes = self.packs.num_resizes
        self.packs.fill(slot, rows)
        if self.packs.num_resizes != resizes:
            self._packs_changed(f"resized for slot {slot}")

    def clear_slot(self, slot: int) -> None:
        self._leader.tell(("clear", slot))
        resizes = self.packs.num_resizes
        self.packs.empty(slot)
        if self.packs.num_resizes != resizes:
            self._packs_changed(f"shrunk after clearing slot {slot}")

    def check_growth(self, slot: int, rows: SlotRows) -> None:
        """Any thread: PacksDoNotFit, with the numbers, when writing ``rows``
        into ``slot`` would grow the packs (as last published) past the
        memory free beside the KV budget's unused part."""
        if self.geometry is None:
            return  # not loaded: the write itself says so
        budget = self.kv_budget.nbytes if self.kv_budget is not None else 0
        check_growth(self.pack_stats, self.geometry, slot, rows, free_bytes(),
                     kv_headroom=max(0, budget - self.snapshot.kv.held_bytes))

    def _packs_changed(self, why: str) -> None:
        before, self.pack_stats = self.pack_stats, self.packs.stats()
        log.info("%s: %s (was %.1f MiB)", why, self.pack_stats.summary(), before.nbytes / 2**20)

    def forget_prompts(self, adapter_keys: list[tuple]) -> int:
        """Drop the prompt cache's entries of unloaded adapters (Lease.key's),
        and store none for them again; returns how many were dropped."""
        cache = self.scheduler.prompt_cache
        if cache is None:
            return 0
        dropped = cache.retire(set(adapter_keys))
        if dropped:
            self._leader.tell(("forget", dropped))
            self.runner.kv.drop(dropped)
        return len(dropped)

    # ---- engine-thread helpers --------------------------------------------

    def _add(self, seq: Sequence) -> None:
        if self.error is not None or self._stopping:
            self._emit(self.scheduler.fail([seq], "The engine has stopped."))
            return
        why = self.kv_budget and self.kv_budget.refusal(seq.num_prompt_tokens, seq.params.max_tokens)
        if why:  # the frontend refuses it first (400); this guards every other caller
            return self._emit(self.scheduler.fail([seq], why))
        if seq.params.seed is None:
            seq.params = replace(seq.params, seed=self._rng.getrandbits(63))
        self.scheduler.add(seq)

    def _abort(self, seq_id: int) -> None:
        seq = self.scheduler.abort(seq_id)
        if seq is not None:
            self._emit([SeqOutput.of(seq)])

    def _fail_step(self, plan: StepPlan, message: str) -> None:
        """A forward pass raised: fail every sequence that had state in the
        batch (its KV cache is gone) and start over with an empty batch."""
        inflight = self.runner.inflight.rows if self.runner.inflight else []
        victims = [s for s in (*plan.decode, *plan.prefill, *inflight) if not s.is_finished]
        victims += self.scheduler.take_batch()
        self.runner.reset()  # the prompt cache's KV state too: it may hang on the failed step
        if self.scheduler.prompt_cache is not None:
            self.scheduler.prompt_cache.clear()
        self._emit(self.scheduler.fail(list(dict.fromkeys(victims)), message))

    def _fail_all(self, message: str) -> None:
        self._emit(self.scheduler.fail_all(message))
        # Answer the commands still queued (they see the engine stopped), so
        # that no caller waits forever.
        self._commands.run()
