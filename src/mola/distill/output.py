"""What `mola distill` writes beside the weights: adapter_config.json as
`mola train` writes it plus how the adapter was distilled (the system
prompt's SHA-256, never the prompt unless --keep-prompt; the teacher; the
data), and the evaluation as JSON beside the adapter."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from .config import DistillConfig
from .data import Example
from .prompts import Questions

EVAL_FILE = "distill_eval.json"  # inside an adapter directory; FILE.distill_eval.json beside a FILE.gguf


def _file_sha256(path: Path | None) -> str | None:
    from ..models.fetch import sha256

    return sha256(path) if path is not None and path.is_file() else None


def teacher_record(config: DistillConfig) -> dict:
    if config.teacher_kind == "url":
        parts = urlsplit(config.teacher_url)  # without any user:password@
        url = urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""), parts.path,
                          "", ""))
        return {"kind": "url", "url": url, "model": config.teacher_model}
    if config.teacher_kind == "model":
        return {"kind": "model", "model": config.teacher}
    return {"kind": "base", "model": config.recipe.model}


def distill_record(config: DistillConfig, questions: Questions, examples: list[Example],
                   system_tokens: int | None, interrupted_at: int | None) -> dict:
    """adapter_config.json's "distill" entry."""
    record = {
        "system_prompt_sha256": config.system_sha256,
        "system_prompt_tokens": system_tokens,
        "teacher": teacher_record(config),
        "loss": config.loss,
        "answers": {"temperature": config.temperature, "max_tokens": config.max_tokens, "examples": len(examples),
                    "tokens": sum(len(e.tokens) - e.offset for e in examples)},
        "data": {"questions": questions.source, "train_questions": len(questions.train),
                 "held_out_questions": len(questions.held_out), "prompts_sha256": _file_sha256(config.prompts),
                 "eval_prompts_sha256": _file_sha256(config.eval_prompts), "seeds_sha256": _file_sha256(config.seeds)},
    }
    if config.loss == "kl":
        record["top_k"] = config.top_k
    if interrupted_at is not None:
        record["interrupted_after_step"] = interrupted_at
    if config.keep_prompt:
        record["system_prompt"] = config.system
    return record


def adapter_config(config: DistillConfig, num_layers: int, lora_parameters: dict, record: dict) -> dict:
    """`mola train`'s adapter_config.json, with the distillation in it."""
    from ..train.run import train_adapter_config

    out = train_adapter_config(config.recipe, num_layers, lora_parameters)
    out.pop("mask_prompt", None)  # the answers alone are learnt, always
    if record.get("interrupted_after_step") is not None:
        out["iters"] = record["interrupted_after_step"]
    out.update(data=record["data"]["questions"], trained_with="mola distill", distill=record)
    return out


def eval_paths(outputs: tuple[Path, ...]) -> list[Path]:
    return [o / EVAL_FILE if o.suffix != ".gguf" else o.with_name(o.stem + "." + EVAL_FILE) for o in outputs]


def write_evaluation(outputs: tuple[Path, ...], evaluation: dict) -> list[Path]:
    paths = eval_paths(outputs)
    for p in paths:
        p.write_text(json.dumps(evaluation, indent=2, ensure_ascii=False) + "\n")
    return paths
