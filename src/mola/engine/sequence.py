"""One request's generation state, as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling and stopping at token level. (Stop *strings* are
    matched on text by the frontend, which aborts the row.)"""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: drawn when the engine takes the sequence
    stop_token_ids: frozenset[int] = frozenset()  # EOS ids: finish with "stop"
    # OpenAI's penalties over the tokens generated so far:
    # logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # Return the sampled token's log-probability and this many alternatives
    # (None: no log-probabilities).
    logprobs: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in 0..20, got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def processes_logits(self) -> bool:
        return self.has_penalties or bool(self.logit_bias)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, nothing computed
    PREFILLING = "prefilling"  # in the prefill batch: its prompt is being written into a KV cache
    RUNNING = "running"  # a row of the decode batch
    FINISHED = "finished"


S = SequenceStatus
# The one table of allowed moves (changed only through Sequence.move_to):
# WAITING -> PREFILLING -> RUNNING -> FINISHED, FINISHED from any other, and
# back to WAITING from PREFILLING or RUNNING when the KV budget preempts it.
TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    S.WAITING: frozenset({S.PREFILLING, S.FINISHED}),  # its prefill starts; aborted, timed out, failed
    # joins the decode batch; preempted; aborted, timed out, failed
    S.PREFILLING: frozenset({S.RUNNING, S.WAITING, S.FINISHED}),
    S.RUNNING: frozenset({S.WAITING, S.FINISHED}),  # preempted; ended
    S.FINISHED: frozenset(),
}


class FinishReason(enum.StrEnum):
    """Why a sequence ended; the values are the API's finish_reason strings."""

    STOP = "stop"  # a stop token
    LENGTH = "length"  # max_tokens, or --request-timeout while running
    ABORT = "abort"  # the client went away, or a stop string was found
    TIMEOUT = "timeout"  # --request-timeout before it produced anything
    ERROR = "error"  # a failed step, a stopped engine, or a grammar that refused a token


BASE_KEY = (("", 0), 1.0)  # the prompt cache's key of the base model's KV state (Sequence.cache_key)


class InvalidTransition(RuntimeError):
    """A status change the table does not allow: a bug, never a user error."""


@dataclass(eq=False)
class Sequence:
    """A prompt on its way through the engine. Plain Python: no arrays."""

    prompt: list[int]
    params: SamplingParams
    slot: int = 0  # adapter slot; 0 is the base model
    lora_scale: float = 1.0  # multiplies the adapter's delta for this row
    # What the slot holds, for the prompt cache: (adapter name, version), or a
    # stack's (key of parts' versions and scales, 1); see Lease.key. None: the
    # base model in slot 0, otherwise unknown, and then nothing is cached.
    adapter_key: tuple | None = None
    seq_id: int | None = None  # None until the engine numbers it (Engine.add)
    status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False)  # changed only through move_to
    output: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = field(default=None, init=False)  # set by move_to(FINISHED, reason)
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() after which the request ends
    num_cached_tokens: int = 0  # prompt tokens whose KV state came from the prompt cache
    # Output tokens at the end that no forward pass was given (the last token
    # of a speculative step, 0 or 1): the KV state lacks them.
    num_unfed_tokens: int = 0
    # A grammar the output must follow (mola.engine.constraint.Constraint):
    # the matcher's state, owned by the engine thread once the sequence is added.
    constraint: Any = None
    # Activated LoRA: the position (of the prompt) from which the adapter's delta
    # applies, the base alone before it; None: every position.
    adapter_start: int | None = None
    num_preemptions: int = 0  # times the KV budget sent it back to the queue
    # A preempted row's PRNG key (two uint32), until it rejoins the decode batch.
    resume_key: tuple[int, int] | None = None
    waited_for_kv: bool = False  # it waited at the head of the queue for KV memory
    # A vision base's prompt with images (mola.engine.vision_rows.VisionPrompt); None: text only.
    vision: Any = None
    # Its multimodal positions run this far ahead of (or behind) its token count, from its
    # prefill on (M-RoPE; set by the runner when its prefill starts); 0: a text row.
    rope_delta: int = 0

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    @property
    def context(self) -> list[int]:
        """Its tokens so far: the prompt, then the output. A preempted
        sequence is prefilled again from all but the last."""
        return self.prompt + self.output if self.output else self.prompt

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def cache_key(self) -> tuple | None:
        """What the KV state of this row depends on besides the base model and
        the tokens (None: unknown, so never cached). An activated LoRA's also
        depends on where its delta starts; a prompt with images, on the
        images' content (their hashes: their tokens are all one id)."""
        if self.adapter_key is None:
            key = BASE_KEY if self.slot == 0 else None
        elif self.adapter_start is not None:
            key = (self.adapter_key, float(self.lora_scale), self.adapter_start)
        else:
            key = (self.adapter_key, float(self.lora_scale))
        if key is not None and self.vision is not None:  # image tokens are one id: key them by the images
            return (*key, ("images", *self.vision.hashes))
        return key

    @property
    def cached_parts(self) -> list[tuple[tuple | None, list[int]]]:
        """The keys and tokens the prompt cache serves and keeps for this row
        when it is prefilled: its context but the last under its own key; for
        an activated LoRA, also the tokens before its start under the base
        model's, since they are the base model's alone."""
        own = (self.cache_key, self.context[:-1])
        if self.adapter_start is not None:
            return [(BASE_KEY, self.context[: self.adapter_start]), own]
        return [own]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def move_to(self, status: SequenceStatus, reason: FinishReason | None = None) -> None:
        """The one way a sequence changes status; FINISHED, and only it, takes a reason."""
        if status not in TRANSITIONS[self.status]:
            raise InvalidTransition(f"sequence {self.seq_id}: {self.status.value} -> {status.value} "
                                    "is not an allowed transition")
        if (reason is None) != (status is not S.FINISHED):
            raise InvalidTransition(f"sequence {self.seq_id}: a finish reason goes with FINISHED only, "
                                    f"got {status.value} and {reason!r}")
        self.status = status
        if reason is not None:
            self.finish_reason = FinishReason(reason)

    def finish(self, reason: FinishReason) -> None:
        self.move_to(S.FINISHED, reason)

    def append(self, token: int) -> FinishReason | None:
        """Record a generated token; returns the finish reason it causes."""
        self.output.append(token)
        if token in self.params.stop_token_ids:
            return FinishReason.STOP
        if len(self.output) >= self.params.max_tokens:
            return FinishReason.LENGTH
        return None

    def take(self, tokens: list[int], last_unfed: bool) -> tuple[int, str | None]:
        """Record a step's tokens (one, or a speculative step's several) up to
        the first that ends the sequence, and finish it then; returns (tokens
        taken, the grammar's error if it refused one). A grammar error ends
        the row (FinishReason.ERROR): never a wrong output."""
        taken, reason, error = 0, None, None
        for token in tokens:
            taken += 1
            reason = self.append(token)
            c = self.constraint
            if c is not None and c.error is not None and c.error_at < len(self.output):
                error, reason = c.error, FinishReason.ERROR
            if reason is not None:
                break
        # the last token of a speculative step was never fed to the model
        self.num_unfed_tokens = int(last_unfed and taken == len(tokens))
        if reason is not None:
            self.finish(reason)
        return taken, error
