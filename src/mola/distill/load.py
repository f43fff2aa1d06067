"""The models of a distillation: the base (the student's), and the teacher
(the base itself, another local model, or a server), with the checks that
need them: a KL teacher's tokenizer, and the system prompt against each context."""

from __future__ import annotations

from typing import Callable

from ..errors import DistillError, TrainError
from .config import DistillConfig
from .teacher import LocalTeacher, RemoteTeacher, prompt_tokens, same_tokenizer


def load_model(model: str, dtype: str, log: Callable[[str], None]):
    from ..models.loader import ModelLoadError, load_base_model

    log(f"[mola] loading {model} ...")
    try:
        return load_base_model(model, dtype=dtype)
    except ModelLoadError as e:
        raise TrainError(e.message) from None


def make_teacher(config: DistillConfig, base, log: Callable[[str], None]):
    """The teacher; DistillError when a KL teacher's tokenizer is not the base's."""
    if config.teacher_kind == "url":
        return RemoteTeacher(config.teacher_url, config.teacher_model, config.system, base.tokenizer,
                             config.teacher_api_key)
    if config.teacher_kind == "base":
        return LocalTeacher(base.model, base.tokenizer, config.system, base.tokenizer, is_student_base=True,
                            context=base.max_model_len)
    other = load_model(config.teacher, config.teacher_dtype, log)
    if config.loss == "kl" and (not same_tokenizer(other.tokenizer, base.tokenizer)
                                or other.vocab_size != base.vocab_size):
        mine, theirs = other.tokenizer.get_vocab(), base.tokenizer.get_vocab()
        raise DistillError(
            f"the teacher {config.teacher} does not have the tokenizer of the model {config.recipe.model} "
            f"({len(mine)} and {len(theirs)} tokens, {len(set(mine.items()) ^ set(theirs.items()))} entries not "
            f"in both; output sizes {other.vocab_size} and {base.vocab_size}): the KL loss compares their "
            "next-token distributions token by token; use --loss sft to learn from its answers' text")
    other.model.freeze()
    return LocalTeacher(other.model, other.tokenizer, config.system, base.tokenizer, is_student_base=False,
                        context=other.max_model_len)


def check_context(config: DistillConfig, base, teacher) -> int | None:
    """The tokens the system prompt adds to a request (the chat template's
    own included); DistillError when the prompt, with room for an answer,
    does not fit the model's or a local teacher's context."""
    if config.system is None:
        return None
    who = [("the model", base.tokenizer, base.max_model_len)]
    if isinstance(teacher, LocalTeacher) and not teacher.is_student_base:
        who.append(("the teacher", teacher.tokenizer, teacher.context))
    for name, tokenizer, context in who:
        total = len(prompt_tokens(tokenizer, config.system, ""))
        if context and total >= context:
            raise DistillError(f"the system prompt is longer than the context: {total} tokens with the chat "
                               f"template, and {name}'s context is {context} tokens")
        longest = max(config.max_tokens, config.eval_max_tokens)
        if context and total + longest > context:
            raise DistillError(f"the system prompt ({total} tokens with the chat template) leaves {name}'s "
                               f"context of {context} tokens no room for answers of --max-tokens "
                               f"{longest}; shorten the prompt or lower --max-tokens")
    return len(prompt_tokens(base.tokenizer, config.system, "")) - len(prompt_tokens(base.tokenizer, None, ""))
