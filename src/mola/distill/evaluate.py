"""The evaluation on held-out questions, answered greedily by the teacher
(with the system prompt), the student (the adapter, without it) and the base
(neither). For the student and the base: how many answers match the
teacher's exactly; on the teacher's answers, the mean KL(teacher || model)
per token and how often the model's most likely token is the teacher's (a
local teacher only); how many answers pass a style check (--check); and the
prompt tokens the student does not prefill."""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np

from .generate import Generated, generate
from .teacher import LocalTeacher, prompt_tokens, without_adapter

EVAL_BATCH = 4  # held-out answers scored in one forward pass


def _text(tokenizer, g: Generated) -> str:
    eos = set(tokenizer.eos_token_ids)
    return tokenizer.decode([t for t in g.tokens if t not in eos]).strip()


def answer_logprobs(model, prompts: list[list[int]], answers: list[list[int]]) -> list:
    """For each prompt and answer, the model's log-probabilities at the
    answer's n tokens ([n, V] float32), from one right-padded forward pass."""
    import mlx.core as mx

    seqs = [p + a[:-1] for p, a in zip(prompts, answers)]
    batch = np.zeros((len(seqs), max(map(len, seqs))), np.int32)  # [B, W]
    for i, seq in enumerate(seqs):
        batch[i, :len(seq)] = seq
    logits = model(mx.array(batch))  # [B, W, V]
    out = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        rows = logits[i, len(p) - 1:len(p) - 1 + len(a)].astype(mx.float32)  # [n, V]
        out.append(rows - mx.logsumexp(rows, axis=-1, keepdims=True))
    return out


def divergence(teacher: LocalTeacher, model, tokenizer, questions: list[str],
               answers: list[Generated]) -> dict[str, tuple[float, float]]:
    """For the student (the adapter on) and the base (off): the mean
    KL(teacher || model) per answer token, and the share of answer tokens
    where the model's most likely token is the teacher's."""
    import mlx.core as mx

    pairs = [(q, a.tokens) for q, a in zip(questions, answers) if a.tokens]
    sums = {"student": [0.0, 0], "base": [0.0, 0]}
    for i in range(0, len(pairs), EVAL_BATCH):
        qs, ans = zip(*pairs[i:i + EVAL_BATCH])
        with teacher.weights():
            t = answer_logprobs(teacher.model, [teacher.prompt(q) for q in qs], list(ans))
        prompts = [prompt_tokens(tokenizer, None, q) for q in qs]
        for name in sums:
            with contextlib.nullcontext() if name == "student" else without_adapter(model):
                s = answer_logprobs(model, prompts, list(ans))
            for ti, si in zip(t, s):  # [n, V] each
                sums[name][0] += (mx.exp(ti) * (ti - si)).sum().item()
                sums[name][1] += (mx.argmax(ti, axis=-1) == mx.argmax(si, axis=-1)).sum().item()
    count = max(sum(len(a) for _, a in pairs), 1)
    return {name: (kl / count, agree / count) for name, (kl, agree) in sums.items()}


def evaluate(model, tokenizer, teacher, questions: list[str], system: str | None, *, max_tokens: int, seed: int,
             check: str | None = None, log: Callable[[str], None] | None = None) -> dict:
    """The evaluation as a JSON-ready dict (see the module's docstring)."""
    if log:
        log(f"[mola] evaluating on {len(questions)} held-out questions (greedy answers of up to {max_tokens} tokens)")
    teacher_answers = teacher.answers(questions, max_tokens=max_tokens, temperature=0.0, seed=seed,
                                      what="the teacher's held-out answers")
    student_prompts = [prompt_tokens(tokenizer, None, q) for q in questions]
    student_answers = generate(model, tokenizer, student_prompts, max_tokens=max_tokens, temperature=0.0, seed=seed)
    with without_adapter(model):
        base_answers = generate(model, tokenizer, student_prompts, max_tokens=max_tokens, temperature=0.0, seed=seed)
    texts = {name: [_text(tokenizer, g) for g in answers] for name, answers in
             (("teacher", teacher_answers), ("student", student_answers), ("base", base_answers))}
    result: dict = {"questions": len(questions), "max_tokens": max_tokens}
    local = isinstance(teacher, LocalTeacher) and teacher.same_tokenizer
    kl = divergence(teacher, model, tokenizer, questions, teacher_answers) if local else {}
    for name in ("student", "base"):
        result[name] = {"exact_match": sum(a == b for a, b in zip(texts[name], texts["teacher"])) / len(questions)}
        if name in kl:
            result[name]["kl_per_token"], result[name]["top1_agreement"] = kl[name]
    if check is not None:
        from ..demo.styles import CHECKS

        result["check"] = {"name": check, **{name: sum(map(CHECKS[check], texts[name])) / len(questions)
                                             for name in ("teacher", "student", "base")}}
    without = sum(map(len, student_prompts)) / len(questions)
    saved = 0.0 if system is None else \
        sum(len(prompt_tokens(tokenizer, system, q)) for q in questions) / len(questions) - without
    result["prompt_tokens"] = {"with_system_prompt": without + saved, "without": without, "saved_per_request": saved}
    result["answers"] = [{"question": q, "teacher": t, "student": s, "base": b}
                         for q, t, s, b in zip(questions, texts["teacher"], texts["student"], texts["base"])]
    return result


def table(result: dict) -> list[str]:
    """The evaluation as the lines `mola distill` prints."""
    n = result["questions"]
    check = result.get("check")
    head = f"{'':22s} {'exact match':>12s} {'KL/token':>9s} {'top-1 agree':>12s}"
    head += f" {'check ' + check['name']:>12s}" if check else ""
    lines = [f"[mola] evaluation on {n} held-out questions, against the teacher's greedy answers:", head]
    for name, label in (("student", "student (adapter)"), ("base", "base (no prompt)")):
        row = result[name]
        line = f"{label:22s} {round(row['exact_match'] * n):>5d}/{n:<6d}"
        line += f" {row['kl_per_token']:>9.3f} {row['top1_agreement']:>12.1%}" if "kl_per_token" in row \
            else f" {'-':>9s} {'-':>12s}"
        line += f" {check[name]:>12.0%}" if check else ""
        lines.append(line)
    if check:
        lines.append(f"{'teacher (prompt)':22s} {'':>12s} {'':>9s} {'':>12s} {check['teacher']:>12.0%}")
    p = result["prompt_tokens"]
    lines.append(f"prefill saved: {p['saved_per_request']:.0f} tokens per request "
                 f"({p['with_system_prompt']:.0f} with the system prompt, {p['without']:.0f} without)")
    return lines
