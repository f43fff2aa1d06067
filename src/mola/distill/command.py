"""`mola distill`'s command line: its parser (the LoRA and optimiser flags
are `mola train`'s, with distillation's defaults) and the settings it makes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..models import DTYPE_CHOICES
from . import config as c


def add_distill_parser(commands) -> argparse.ArgumentParser:
    from ..train.flags import add_recipe_flags

    p = commands.add_parser(
        "distill", help="bake a system prompt (or a teacher's behaviour) into a LoRA adapter",
        description="Train a LoRA adapter so that the base model without the system prompt answers as it "
        "does with it. The teacher (the base with --system, or --teacher, or --teacher-url) answers questions "
        "(--prompts, or its own from seed topics); the student (the base plus a fresh LoRA) learns its "
        "next-token distributions over those answers (--loss kl) or their tokens (--loss sft), in mlx-lm's "
        "tuner. Held-out questions evaluate the result; the evaluation is printed and written beside the "
        "adapter. adapter_config.json records the prompt's SHA-256, not the prompt (unless --keep-prompt).")
    p.add_argument("--model", required=True, help="base model: a local directory, a GGUF file or a hub id")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system", metavar="TEXT", help="the system prompt to bake in")
    system.add_argument("--system-file", type=Path, metavar="FILE", help="the system prompt, from a file")
    p.add_argument("--out", required=True, action="append", metavar="ADAPTER_DIR|FILE.gguf",
                   help="an mlx-lm adapter directory or a FILE.gguf (give it twice for both)")
    _question_flags(p)
    _teacher_flags(p)
    add_recipe_flags(p, iters=c.DEFAULT_ITERS, learning_rate=c.DEFAULT_LEARNING_RATE, step="step",
                     dtype_help="keep (default) or a float dtype to dequantize the base to (float32 trains a "
                     "small GGUF base several times faster on a CPU)")
    p.add_argument("--load-into", metavar="URL", help="when done, load the adapter into the mola server at "
                   "URL (POST URL/v1/adapters); the server must allow the path")
    return p


def _question_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=Path, metavar="FILE", help="questions, one per line: text, or JSONL "
                   "(a string, or {\"prompt\"|\"question\"|\"messages\"}); default: the teacher writes them")
    p.add_argument("--eval-prompts", type=Path, metavar="FILE",
                   help="held-out questions (default: --held-out of --prompts are kept back)")
    p.add_argument("--held-out", type=int, default=c.DEFAULT_HELD_OUT, metavar="N",
                   help=f"questions kept back for the evaluation, at most a fifth (default {c.DEFAULT_HELD_OUT})")
    p.add_argument("--seeds", type=Path, metavar="FILE",
                   help="without --prompts: topics, one per line, the teacher writes questions about "
                   "(default: a built-in list)")
    p.add_argument("--num-questions", type=int, default=c.DEFAULT_NUM_QUESTIONS, metavar="N",
                   help=f"without --prompts: questions the teacher writes (default {c.DEFAULT_NUM_QUESTIONS}, "
                   "fewer after deduplication)")
    p.add_argument("--max-tokens", type=int, default=c.DEFAULT_MAX_TOKENS,
                   help=f"the longest answer of the teacher (default {c.DEFAULT_MAX_TOKENS})")
    p.add_argument("--eval-max-tokens", type=int, metavar="N",
                   help="the longest held-out answer in the evaluation (default: --max-tokens)")
    p.add_argument("--temperature", type=float, default=c.DEFAULT_TEMPERATURE,
                   help="the teacher's sampling temperature for the training answers (default 1)")
    p.add_argument("--check", help="also count the held-out answers that pass this mola.demo style check "
                   "(title, json or pirate)")
    p.add_argument("--keep-prompt", action="store_true",
                   help="write the system prompt itself into adapter_config.json (default: its SHA-256 only)")


def _teacher_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loss", choices=c.LOSSES, help="kl (default): the teacher's next-token distributions; "
                   "sft: its answers' tokens (the default with --teacher-url)")
    p.add_argument("--kl-top-k", type=int, default=c.DEFAULT_TOP_K, metavar="K",
                   help=f"the teacher's K most likely tokens (and the rest's mass) make its distribution "
                   f"(default {c.DEFAULT_TOP_K})")
    p.add_argument("--teacher", metavar="MODEL", help="another local model as the teacher (with --system when "
                   "given); the same tokenizer for --loss kl")
    p.add_argument("--teacher-dtype", choices=DTYPE_CHOICES, default="auto",
                   help="the --teacher model's dtype, as mola serve's --dtype (default auto)")
    p.add_argument("--teacher-url", metavar="URL", help="an OpenAI-compatible server as the teacher "
                   "(mola, or any API); its answers are learnt with --loss sft")
    p.add_argument("--teacher-model", metavar="ID", help="the model id to ask at --teacher-url")
    p.add_argument("--teacher-api-key", help="bearer key for --teacher-url (default: $OPENAI_API_KEY)")


def config_from_args(args: argparse.Namespace) -> c.DistillConfig:
    """The settings; ValueError naming the bad one."""
    from ..train import TrainConfig

    system = args.system
    if args.system_file is not None:
        try:
            system = args.system_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --system-file {args.system_file}: {getattr(e, 'strerror', e)}") from None
    recipe = TrainConfig(
        model=args.model, data=args.prompts or args.seeds or Path("."), out=tuple(args.out), rank=args.rank,
        scale=args.scale, dropout=args.dropout, layers=args.layers, iters=args.iters, batch_size=args.batch_size,
        learning_rate=args.learning_rate, targets=args.targets, lr_schedule=args.lr_schedule, warmup=args.warmup,
        grad_clip=args.grad_clip, max_seq_length=args.max_seq_length, mask_prompt=True, seed=args.seed,
        steps_per_report=args.steps_per_report, grad_checkpoint=args.grad_checkpoint, force=args.force,
        name=args.name, serve_url=args.load_into, gguf_outtype=args.gguf_outtype, dtype=args.dtype,
        api_key=args.api_key or os.environ.get("MOLA_ADMIN_KEY") or os.environ.get("MOLA_API_KEY") or None,
    )
    return c.DistillConfig(
        recipe=recipe, system=system, prompts=args.prompts, eval_prompts=args.eval_prompts, held_out=args.held_out,
        seeds=args.seeds, num_questions=args.num_questions, loss=args.loss, teacher=args.teacher,
        teacher_url=args.teacher_url, teacher_model=args.teacher_model, teacher_dtype=args.teacher_dtype,
        teacher_api_key=args.teacher_api_key or os.environ.get("OPENAI_API_KEY") or None,
        max_tokens=args.max_tokens, eval_max_tokens=args.eval_max_tokens, temperature=args.temperature,
        top_k=args.kl_top_k,
        keep_prompt=args.keep_prompt, check=args.check,
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse the settings (a usage error, exit 2, when one is bad), then distill."""
    from ..blas import maybe_reexec_with_openblas

    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    maybe_reexec_with_openblas(argv, enabled=not args.no_openblas)
    from .run import run

    return run(config)
