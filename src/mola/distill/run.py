"""`mola distill`'s run: check what can be checked before anything loads,
load the base and the teacher, refuse what cannot work before training (no
questions, a system prompt longer than the context, a KL teacher with
another tokenizer), have the teacher answer, train with mlx-lm's tuner,
write the adapter, evaluate it on the held-out questions and, with
--load-into, load it into a running mola."""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import DistillError, TrainError
from ..train.output import check_output, hot_load, place
from ..train.progress import Progress
from ..train.run import run_command
from .config import DistillConfig
from .data import Example, build_examples
from .evaluate import evaluate, table
from .fit import fit
from .load import check_context, load_model, make_teacher
from .output import adapter_config, distill_record, write_evaluation
from .prompts import QUESTION_REQUEST, Questions, from_files, read_seeds, written_questions
from .teacher import prompt_tokens

QUESTION_MAX_TOKENS = 48  # the longest question the teacher writes


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class DistillResult:
    outputs: tuple[Path, ...]  # the adapter directory and/or FILE.gguf
    seconds: float
    train_loss: float | None
    evaluation: dict | None = None  # None when Ctrl-C cut the training short
    interrupted_after: int | None = None  # then: the steps the adapter written holds
    served: dict | None = None  # --load-into's answer


def distill(config: DistillConfig, log: Callable[[str], None] = _stderr) -> DistillResult:
    """Check, load, teach, train, write and evaluate. Raises TrainError (or
    DistillError, OutputPathError); Ctrl-C after the first training step
    writes the adapter of the last finished step and returns."""
    t0 = time.perf_counter()
    questions = _check_inputs(config, log)
    base = load_model(config.recipe.model, config.recipe.dtype, log)
    teacher = make_teacher(config, base, log)
    system_tokens = check_context(config, base, teacher)
    keys, num_layers = _lora_plan(config, base)
    questions = questions or _written_questions(config, teacher, log)
    examples = _examples(config, base.tokenizer, teacher, questions.train, log)
    lora_parameters = _add_lora(config, base, keys, num_layers, log)
    progress = Progress(config.recipe.iters, log)
    out = config.recipe.mlx_lm_out or config.recipe.gguf_out
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.resolve().stem}.distill-", dir=out.resolve().parent))
    try:
        stopped = fit(base.model, config.recipe, config.loss, examples, tmp / "adapters.safetensors", progress)
        record = distill_record(config, questions, examples, system_tokens, stopped)
        (tmp / "adapter_config.json").write_text(
            json.dumps(adapter_config(config, num_layers, lora_parameters, record), indent=2) + "\n")
        _place(config, base, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = DistillResult(config.recipe.outputs, time.perf_counter() - t0, progress.train_loss,
                           interrupted_after=stopped)
    written = " and ".join(map(str, config.recipe.outputs))
    if stopped is not None:
        log(f"[mola] interrupted: the adapter after {stopped} of {config.recipe.iters} steps was written to {written}")
        return result
    log(f"[mola] adapter written to {written} in {result.seconds:.0f} s"
        + (f" (final training loss {result.train_loss:.3f})" if result.train_loss is not None else ""))
    try:
        _evaluate(config, base, teacher, questions, result, log)
    except KeyboardInterrupt:
        log(f"[mola] interrupted during the evaluation; the adapter is written to {written}")
        result.interrupted_after = config.recipe.iters
    return result


def _evaluate(config: DistillConfig, base, teacher, questions: Questions, result: DistillResult,
              log: Callable[[str], None]) -> None:
    """The evaluation, printed and written beside the adapter; then --load-into."""
    r = config.recipe
    result.evaluation = evaluate(base.model, base.tokenizer, teacher, questions.held_out, config.system,
                                 max_tokens=config.eval_max_tokens, seed=r.seed, check=config.check, log=log)
    for line in table(result.evaluation):
        log(line)
    paths = write_evaluation(r.outputs, result.evaluation)
    log(f"[mola] evaluation written to {', '.join(map(str, paths))}")
    if r.serve_url:
        result.served = hot_load(r.serve_url, r.adapter_name, r.out, r.api_key)
        log(f"[mola] {r.serve_url} now serves the adapter as model '{r.adapter_name}'")


def _check_inputs(config: DistillConfig, log: Callable[[str], None]) -> Questions | None:
    """What can be checked before a model loads: the question files, the
    model paths and the outputs. Returns the questions when files give them."""
    from ..models.loader import looks_like_hub_id

    recipe = config.recipe
    questions = None
    if config.prompts is not None:
        questions = from_files(config.prompts, config.eval_prompts, config.held_out, recipe.seed)
        _check_batch(len(questions.train), recipe.batch_size, "training questions")
        log(f"[mola] questions: {len(questions.train)} to train on and {len(questions.held_out)} held out "
            f"({questions.source})")
    else:
        read_seeds(config.seeds)
    inputs = [p for p in (config.prompts, config.eval_prompts, config.seeds) if p is not None]
    for name in (recipe.model, config.teacher):
        if name is not None and Path(name).expanduser().exists():
            inputs.append(Path(name).expanduser())
        elif name is not None and not looks_like_hub_id(name):
            raise TrainError(f"the model path does not exist: {Path(name).expanduser()}")
    for out in recipe.outputs:
        check_output(out, recipe.force, tuple(inputs))
    return questions


def _check_batch(n: int, batch_size: int, what: str) -> None:
    if n < batch_size:
        raise DistillError(f"{n} {what} cannot fill a batch of {batch_size}; lower --batch-size or add questions")


def _written_questions(config: DistillConfig, teacher, log: Callable[[str], None]) -> Questions:
    """Questions the teacher writes, ``num_questions`` tries spread over the seeds."""
    seeds = read_seeds(config.seeds)
    per_seed = math.ceil(config.num_questions / len(seeds))
    log(f"[mola] the teacher writes {per_seed * len(seeds)} questions from {len(seeds)} seeds ...")
    requests = [QUESTION_REQUEST.format(seed=s) for s in seeds for _ in range(per_seed)]
    texts = teacher.texts(requests, max_tokens=QUESTION_MAX_TOKENS, temperature=1.0, seed=config.recipe.seed)
    questions = written_questions(seeds, [texts[i * per_seed:(i + 1) * per_seed] for i in range(len(seeds))],
                                  config.held_out)
    _check_batch(len(questions.train), config.recipe.batch_size, "training questions written by the teacher")
    log(f"[mola] questions: {len(questions.train)} to train on and {len(questions.held_out)} held out "
        f"({questions.source}, deduplicated)")
    return questions


def _examples(config: DistillConfig, tokenizer, teacher, questions: list[str],
              log: Callable[[str], None]) -> list[Example]:
    """The teacher's sampled answers (with its top-K distributions for kl) as training examples."""
    log(f"[mola] the teacher answers {len(questions)} questions (sampled at temperature {config.temperature:g}, "
        f"up to {config.max_tokens} tokens) ...")
    answers = teacher.answers(questions, max_tokens=config.max_tokens, temperature=config.temperature,
                              seed=config.recipe.seed, top_k=config.top_k if config.loss == "kl" else 0, log=log)
    prompts = [prompt_tokens(tokenizer, None, q) for q in questions]
    examples = build_examples(prompts, answers, config.recipe.max_seq_length)
    _check_batch(len(examples), config.recipe.batch_size, "non-empty teacher answers")
    return examples


def _lora_plan(config: DistillConfig, base) -> tuple[list[str], int]:
    """`mola train`'s target modules and layers for the base (and its GGUF
    output checked), before the teacher's answers are paid for."""
    from ..train.export import check_gguf_export
    from ..train.run import layers_to_train, resolve_targets

    num_layers = layers_to_train(config.recipe, len(base.model.layers))
    keys = resolve_targets(base.model, config.recipe.targets)
    if config.recipe.gguf_out is not None:
        check_gguf_export(base.config, keys)
    return keys, num_layers


def _add_lora(config: DistillConfig, base, keys: list[str], num_layers: int, log: Callable[[str], None]) -> dict:
    """`mola train`'s LoRA layers on the base; their lora_parameters."""
    from ..train.run import add_lora_layers

    lora_parameters, _ = add_lora_layers(base.model, config.recipe, keys, num_layers, log)
    return lora_parameters


def _place(config: DistillConfig, base, tmp: Path) -> None:
    """The adapter moved into place: a directory and/or a GGUF file written by mola train's writer."""
    from ..train.export import write_gguf

    r = config.recipe
    if r.gguf_out is not None:
        write_gguf(tmp, r.gguf_out, base.config, r.model, r.gguf_outtype)
    if r.mlx_lm_out is not None:
        place(tmp, r.mlx_lm_out)


def run(config: DistillConfig) -> int:
    """`mola distill`'s exit status: 0 when the adapter is written and
    evaluated (and loaded), 130 after Ctrl-C, 1 with a message otherwise."""
    status, result = run_command(lambda: distill(config))
    if status:
        return status
    return 130 if result.interrupted_after is not None else 0
