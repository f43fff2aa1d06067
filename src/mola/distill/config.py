"""`mola distill`'s settings: one frozen dataclass, checked when it is made.

The LoRA, the optimiser and the output are `mola train`'s own settings (a
TrainConfig, checked by it); the rest says who the teacher is, which
questions it answers and how the student learns from its answers."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..train import TrainConfig

LOSSES = ("kl", "sft")
# Distillation learns a shift of the whole distribution, not a few answers:
# a higher rate than `mola train`'s default and fewer iterations.
DEFAULT_ITERS = 200
DEFAULT_LEARNING_RATE = 1e-4
DEFAULT_HELD_OUT = 16  # questions kept back for the evaluation, when one set is split
DEFAULT_NUM_QUESTIONS = 256  # questions the teacher writes from the seeds
DEFAULT_MAX_TOKENS = 128  # the longest teacher answer
DEFAULT_TEMPERATURE = 1.0  # the teacher's sampling temperature for the training answers
# The teacher's distribution is kept as its K most likely tokens and the mass
# of the rest: K logits per answer token instead of the whole vocabulary.
DEFAULT_TOP_K = 64


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class DistillConfig:
    recipe: TrainConfig  # model, out, LoRA and optimiser; serve_url is --load-into
    system: str | None = field(default=None, repr=False)  # the system prompt to bake in
    prompts: Path | None = None  # questions: JSONL or text, one per line
    eval_prompts: Path | None = None  # held-out questions (default: split off the prompts)
    held_out: int = DEFAULT_HELD_OUT
    seeds: Path | None = None  # without prompts: topics the teacher writes questions about
    num_questions: int = DEFAULT_NUM_QUESTIONS
    loss: str | None = None  # "kl" or "sft"; None: kl, or sft for a --teacher-url
    teacher: str | None = None  # another model as teacher (the same tokenizer for kl)
    teacher_url: str | None = None  # an OpenAI-compatible server as teacher (sft)
    teacher_model: str | None = None  # the model id at teacher_url
    teacher_api_key: str | None = field(default=None, repr=False)
    teacher_dtype: str = "auto"  # --teacher loaded as mola serve --dtype loads it
    max_tokens: int = DEFAULT_MAX_TOKENS
    eval_max_tokens: int | None = None  # the held-out answers' longest (None: max_tokens)
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    keep_prompt: bool = False  # write the prompt itself into adapter_config.json
    check: str | None = None  # a style check of mola.demo.styles.CHECKS for the evaluation

    def __post_init__(self):
        for name in ("prompts", "eval_prompts", "seeds"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value).expanduser())
        if self.loss is None:
            object.__setattr__(self, "loss", "sft" if self.teacher_url else "kl")
        if self.eval_max_tokens is None:
            object.__setattr__(self, "eval_max_tokens", self.max_tokens)
        self._check_teacher()
        self._check_numbers()
        if self.prompts is not None and self.seeds is not None:
            raise ValueError("give --prompts or --seeds, not both (seeds are for questions the teacher writes)")
        if self.check is not None:
            from ..demo.styles import CHECKS

            if self.check not in CHECKS:
                raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {self.check!r}")

    def _check_teacher(self) -> None:
        if self.system is not None and not self.system.strip():
            raise ValueError("the system prompt is empty")
        if self.system is None and self.teacher is None and self.teacher_url is None:
            raise ValueError("give the system prompt to bake in (--system or --system-file), or a "
                             "--teacher or --teacher-url whose behaviour to distil")
        if self.teacher is not None and self.teacher_url is not None:
            raise ValueError("give --teacher or --teacher-url, not both")
        if self.teacher_url is not None:
            if not re.match(r"^https?://[^\s/]+", self.teacher_url):
                raise ValueError(f"teacher_url must be an http:// or https:// URL, got {self.teacher_url!r}")
            if not self.teacher_model:
                raise ValueError("--teacher-url needs --teacher-model (the model id to ask)")
            if self.loss == "kl":
                raise ValueError("a --teacher-url gives answers, not next-token distributions: "
                                 "use --loss sft with it")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")

    def _check_numbers(self) -> None:
        for name, low in (("held_out", 1), ("num_questions", 1), ("max_tokens", 1), ("eval_max_tokens", 1),
                          ("top_k", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")

    @property
    def system_sha256(self) -> str | None:
        return None if self.system is None else sha256_text(self.system)

    @property
    def teacher_kind(self) -> str:
        """"base" (the base with the prompt), "model" (--teacher) or "url" (--teacher-url)."""
        return "url" if self.teacher_url else "model" if self.teacher else "base"
