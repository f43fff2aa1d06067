"""Every adapter kind in one batch (issue 45): a PEFT DoRA adapter, PEFT's
LoRA on the embedding and on the head, trainable tokens, an embedding LoRA
tied to the head, plain LoRA, an activated LoRA and base rows, all in the
same steps of one engine on a tied model. Each row is checked token by token
against its own reference computed another way (the DoRA formula merged with
numpy; the embedding/head parts merged into plain mlx-lm's weights), fed the
row's own tokens: the token mola chose is within a small margin of the
reference's best, and its log-probability is the reference's within float
tolerance (helpers.dora.check_row)."""

from __future__ import annotations

import random

import pytest

from helpers.dora import check_row, numpy_merged, reference_logprobs, write_peft_dora
from helpers.engines import EngineRunner, together
from helpers.vocab import make_vocab_adapters, merged_vocab_model, tied_copy
from mola.adapters.recipe import read_checked

MAX_TOKENS = 8
ALORA_START = 7  # the activated row's adapter applies from this prompt position on


@pytest.fixture(scope="module")
def every_kind(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("every-kind")
    model_dir = tied_copy(tiny_model, root / "tied")
    adapters = make_vocab_adapters(root, model_dir, tied=True)  # lin, emb, head, tok, tie
    dora_dir, dora_weights = write_peft_dora(root / "dora", model_dir)
    return model_dir, {**adapters, "dora": dora_dir}, dora_weights


def test_dora_vocab_lora_activated_and_base_rows_share_one_batch(every_kind):
    model_dir, adapters, dora_weights = every_kind
    r = EngineRunner(model_dir, max_tokens=MAX_TOKENS, max_loras=len(adapters), prefill_step_size=6)
    kinds = {}
    for name, path in adapters.items():  # read as the server reads them
        weights = read_checked(str(path), r.engine.geometry, r.loaded.config)
        kinds[name] = weights.kind
        r.add(name, weights)
    assert kinds["dora"] == "dora" and all(k == "lora" for n, k in kinds.items() if n != "dora")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 14, 21)]
    jobs = [(name, i) for i in range(len(prompts)) for name in (None, *adapters)]
    rng.shuffle(jobs)
    try:
        seqs = together(r, lambda: [r.submit(prompts[i], name, logprobs=1) for name, i in jobs]
                        + [r.submit(prompts[2], "lin", adapter_start=ALORA_START, logprobs=1)])
        r.wait(seqs)
        logprobs = {s.seq_id: r.logprobs[s.seq_id] for s in seqs}
    finally:
        r.stop()
    refs = {name: merged_vocab_model(model_dir, adapters[name] if name else None, True)
            for name in (None, *adapters) if name != "dora"}
    refs["dora"] = numpy_merged(model_dir, dora_weights)
    for (name, i), s in zip(jobs, seqs):
        prompt = prompts[i]
        check_row(s.output, logprobs[s.seq_id],
                  reference_logprobs(refs[name], refs[name], prompt + s.output, 0, len(prompt)), MAX_TOKENS)
    activated = seqs[-1]
    check_row(activated.output, logprobs[activated.seq_id],
              reference_logprobs(refs[None], refs["lin"], prompts[2] + activated.output, ALORA_START,
                                 len(prompts[2])), MAX_TOKENS)
    # the kinds answer differently from each other and from the base on one prompt
    answers = {name: tuple(s.output) for (name, i), s in zip(jobs, seqs) if i == 1}
    assert len(set(answers.values())) == len(answers), answers
