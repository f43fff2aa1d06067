"""`mola distill`: bake a system prompt, or a teacher's behaviour, into a LoRA adapter.

    mola distill --model BASE --system TEXT|--system-file F --out ADAPTER_DIR|FILE.gguf
                 [--prompts FILE [--eval-prompts FILE]] [--loss kl|sft]
                 [--teacher MODEL | --teacher-url URL --teacher-model ID]
                 [mola train's --rank, --layers, --target, --iters, --learning-rate, ...]
                 [--load-into URL --name NAME]

The teacher is the base with the system prompt (or --teacher, or a server);
the student is the base plus a fresh LoRA, without the prompt. The teacher
answers questions (from --prompts, or written by itself from seed topics);
the student learns its next-token distributions over those answers (KL, the
default) or its answers' tokens (--loss sft), in mlx-lm's tuner. The adapter
records the prompt's SHA-256, never the prompt (unless --keep-prompt).

    config.py    DistillConfig: the settings, checked when made (mola train's TrainConfig inside)
    prompts.py   the questions: read, or written by the teacher; deduplicated, a held-out split
    teacher.py   the teacher: a local model with the prompt, or an OpenAI-compatible server
    generate.py  a local model's answers (mlx-lm's BatchGenerator), with their top-K distributions
    load.py      the models, and the checks that need them (tokenizer, context)
    data.py      the training examples and their batches
    loss.py      the KL and SFT losses, as mlx-lm's trainer takes them
    fit.py       mlx-lm's trainer with them, Ctrl-C keeping the last finished step
    evaluate.py  the held-out evaluation: exact match, KL per token, checks, prefill saved
    output.py    adapter_config.json's record and the evaluation's JSON
    run.py       the run, in order; command.py its command line
"""

from ..errors import DistillError
from .config import DistillConfig
from .run import DistillResult, distill, run

__all__ = ["DistillConfig", "DistillError", "DistillResult", "distill", "run"]
