"""Vision-language bases in the mixed batch (mola.engine.vision_rows,
mola.models.vision): mola's greedy answer to a chat with an image equals
mlx-vlm's own ``generate`` on the same image, with the adapter (as
``mlx_vlm.train`` writes it) fused into the weights by mlx-vlm; alone, and
in one batch with a text-only row, a base row and another adapter's image
row. Skipped without mlx-vlm, saying why (MOLA_REQUIRE_VISION=1: failed)."""

from __future__ import annotations

import pytest

from helpers.vision import require_mlx_vlm

require_mlx_vlm()  # skipped without mlx-vlm, saying why; failed where MOLA_REQUIRE_VISION=1 (CI)

from helpers.engines import EngineRunner, together
from helpers.vision_models import (image_chat, image_input, make_tiny_idefics3, make_tiny_qwen2_5_vl,
                                   make_tiny_qwen2_vl, make_vlm_adapter, merged_vlm, vlm_greedy)

from mola.frontend.vision_prompt import encode_vision_prompt

MAX_TOKENS = 8


# Each family: Qwen2-VL and Qwen2.5-VL (M-RoPE: positions and rope deltas per row), Idefics3 (SmolVLM:
# llama, 1-D positions).
FAMILIES = {"qwen2_vl": make_tiny_qwen2_vl, "qwen2_5_vl": make_tiny_qwen2_5_vl, "idefics3": make_tiny_idefics3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(model directory, adapter a, adapter b) of one family (the name is the first's)."""
    root = tmp_path_factory.mktemp(request.param)
    model = FAMILIES[request.param](root / "model")
    return model, make_vlm_adapter(root / "a", model, seed=1), make_vlm_adapter(root / "b", model, seed=2, rank=2)


@pytest.fixture(scope="module")
def runner(family):
    model, a, b = family
    r = EngineRunner(model, [("a", a), ("b", b)], max_tokens=MAX_TOKENS)
    yield r
    r.stop()


def reference(model_dir, adapter, chat, images, scale: float = 1.0, max_tokens: int = MAX_TOKENS,
              **generate_args) -> list[int]:
    """mlx-vlm's own greedy answer, ``adapter`` (or None) fused into its weights at ``scale``."""
    m, processor = merged_vlm(model_dir, adapter, scale)
    return vlm_greedy(m, processor, chat, [im.image for im in images], max_tokens, **generate_args)


def with_images(chat: list[dict], images) -> list[dict]:
    """``chat`` with its image parts holding ``images``, in order, as the frontend hands them on."""
    it = iter(images)
    return [m if isinstance(m["content"], str) else
            {**m, "content": [{**p, "image": next(it)} if p["type"] == "image" else p for p in m["content"]]}
            for m in chat]


def submit(runner, chat, images, adapter=None, **params):
    """A chat's row, stopping at the tokenizer's EOS as mlx-vlm's generate does."""
    loaded = runner.loaded
    ids, vision = encode_vision_prompt(loaded.processor, with_images(chat, images), loaded.model.image_token_id)
    params = {"stop_token_ids": frozenset(loaded.tokenizer.eos_token_ids), **params}
    return runner.submit(ids, adapter, vision=vision, **params)


def test_an_image_row_alone_equals_mlx_vlm(runner, family):
    model, a, _ = family
    im = image_input(0)
    want = reference(model, a, image_chat("What is this?"), [im])
    seq = together(runner, lambda: submit(runner, image_chat("What is this?"), [im], "a"))
    assert runner.wait([seq])[0] == want
    if runner.loaded.model.takes_positions:
        assert seq.rope_delta < 0  # M-RoPE: the image's positions ran behind its tokens


def test_image_rows_in_one_batch_with_text_base_and_other_adapter_rows(runner, family):
    model, a, b = family
    im0, im1 = image_input(0), image_input(1, (16, 32))
    text = [{"role": "user", "content": [{"type": "text", "text": "Tell me about autumn leaves."}]}]
    cases = [  # (chat, images, adapter)
        (image_chat("What is this?"), [im0], "a"),
        (text, [], "a"),  # a text-only row of the same adapter
        (image_chat("Describe it"), [im1], None),  # a base row with an image
        (image_chat("And these two?", 2), [im1, im0], "b"),  # another adapter, two images
        (text, [], None),  # a base text row
    ]
    want = [reference(model, {"a": a, "b": b, None: None}[ad], chat, ims) for chat, ims, ad in cases]
    seqs = together(runner, lambda: [submit(runner, chat, ims, ad) for chat, ims, ad in cases])
    got = runner.wait(seqs)
    assert got == want
    assert len({tuple(w) for w in want}) == len(want)  # every row's answer is its own


def test_a_row_joining_mid_decode_answers_as_alone(runner):
    """Rows decoding beside others (joining mid-decode) answer as they do alone."""
    im = image_input(2)
    alone = runner.wait([together(runner, lambda: submit(runner, image_chat("Why?"), [im], "b"))])[0]
    first = together(runner, lambda: submit(runner, image_chat("What is this?"), [image_input(0)], "a",
                                            max_tokens=30))
    runner.wait_decoding([first])
    later = submit(runner, image_chat("Why?"), [im], "b")
    assert runner.wait([first, later])[1] == alone


def test_a_second_turn_about_one_image_reuses_its_prefix_and_another_image_never_does(runner, family):
    model, a, _ = family
    im, other = image_input(3), image_input(4)  # one size: the same tokens, other pixels
    first = image_chat("What is this?")
    seq = together(runner, lambda: submit(runner, first, [im], "a"))
    answer = runner.loaded.tokenizer.decode(runner.wait([seq])[0])
    second = first + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": [{"type": "text", "text": "And its colour?"}]}]
    towers = []  # the prompts the vision tower ran for
    image_rows = runner.loaded.model.image_rows
    runner.loaded.model.image_rows = lambda tokens, arrays: towers.append(tokens) or image_rows(tokens, arrays)
    try:
        again = together(runner, lambda: submit(runner, second, [im], "a"))
        assert runner.wait([again])[0] == reference(model, a, second, [im])
    finally:
        del runner.loaded.model.image_rows
    assert again.num_cached_tokens >= len(seq.prompt) - 1  # the first turn's prompt, image included
    assert towers == []  # its image was in the cached prefix: the tower did not run again
    elsewhere = together(runner, lambda: submit(runner, second, [other], "a"))
    assert elsewhere.prompt == again.prompt  # the same token ids...
    assert runner.wait([elsewhere])[0] == reference(model, a, second, [other])
    assert elsewhere.num_cached_tokens == 0  # ...but another image: no entry of the first one's


def test_a_peft_copy_by_hugging_face_names_at_a_request_scale_beside_the_original(runner, family, tmp_path):
    """The same adapter as PEFT writes it for the Hugging Face VLM (its
    decoder under model.language_model.), at lora_scale 0.5, in one batch
    with the mlx-vlm original at 1."""
    from mola.adapters.weights import LoRAWeights
    from mola.testing.peft import save_peft_adapter

    model, a, _ = family
    hf = {p.replace("model.layers.", "model.language_model.layers."): m for p, m in runner.read(a).modules.items()}
    runner.add("peft", runner.read(save_peft_adapter(tmp_path / "peft", LoRAWeights("hf", "peft", hf))))
    im = image_input(5)
    want = [reference(model, a, image_chat("What is this?"), [im], 0.5), reference(model, a, image_chat("Why?"), [im])]
    seqs = together(runner, lambda: [submit(runner, image_chat("What is this?"), [im], "peft", lora_scale=0.5),
                                     submit(runner, image_chat("Why?"), [im], "a")])
    assert runner.wait(seqs) == want


@pytest.mark.parametrize("setting, flag", [({"kv_bits": 8}, "--kv-bits"),
                                           ({"speculative": {"method": "ngram"}}, "--speculative")])
def test_a_vision_base_refuses_what_its_rows_cannot_take(family, setting, flag):
    from mola.engine.config import SpeculativeConfig
    from mola.errors import ModelLoadError

    if "speculative" in setting:
        setting = {"speculative": SpeculativeConfig(**setting["speculative"])}
    with pytest.raises(ModelLoadError, match=f"vision model.*without {flag}"):
        EngineRunner(family[0], **setting)


def test_image_rows_prefilled_a_few_columns_a_step_answer_as_mlx_vlm(family):
    """A prefill in chunks of 8 columns: each chunk takes its columns of the
    rows' embeddings and positions (an image straddles chunks)."""
    model, a, b = family
    im0, im1 = image_input(0), image_input(1, (16, 32))
    chunked = EngineRunner(model, [("a", a), ("b", b)], max_tokens=MAX_TOKENS, prefill_step_size=8)
    try:
        cases = [(image_chat("What is this?"), [im0], "a"), (image_chat("And these?", 2), [im1, im0], "b"),
                 ([{"role": "user", "content": "Tell me about autumn leaves."}], [], None)]
        seqs = together(chunked, lambda: [submit(chunked, c, ims, ad) for c, ims, ad in cases])
        assert chunked.wait(seqs) == [reference(model, {"a": a, "b": b, None: None}[ad], c, ims)
                                      for c, ims, ad in cases]
    finally:
        chunked.stop()


@pytest.mark.parametrize("prompt_cache_bytes", [0, None])
def test_preempted_image_rows_come_back_with_mlx_vlms_answer(family, runner, prompt_cache_bytes):
    """A KV budget that admits three image rows at their prompts and cannot
    hold three at their longest (as tests/test_kv_budget.py forces it): rows
    are preempted as they grow, and prefilled again from their prompt and
    output (no prompt cache: the tower runs again; with one: from what it kept)."""
    from mola.engine.kv_budget import peak
    from mola.engine.scheduler import ADMISSION_HEADROOM

    model, a, b = family
    num = 24
    cases = [(image_chat(q), [image_input(10 + i)], ad) for i, (q, ad) in
             enumerate([("What is this?", "a"), ("Why so?", "b"), ("Describe it", None), ("And this?", "a")])]
    longest = max(len(encode_vision_prompt(runner.loaded.processor, with_images(c, ims),
                                           runner.loaded.model.image_token_id)[0]) for c, ims, _ in cases)
    bytes_per_token = runner.engine.call(lambda: runner.engine.runner.kv_position_bytes).result(timeout=30)
    start, end = peak([(longest, 2 + ADMISSION_HEADROOM)] * 3), peak([(longest + num, 1)] * 3)
    assert start < end
    no_eos = {t: -1e9 for t in runner.loaded.tokenizer.eos_token_ids}  # every row grows to its num tokens
    cache = {} if prompt_cache_bytes is None else {"prompt_cache_bytes": prompt_cache_bytes}
    bounded = EngineRunner(model, [("a", a), ("b", b)], max_tokens=num,
                           kv_cache_bytes=(start + end) // 2 * bytes_per_token, **cache)
    towers = []  # the prompts the vision tower ran for
    image_rows = bounded.loaded.model.image_rows
    bounded.loaded.model.image_rows = lambda tokens, arrays: towers.append(tokens) or image_rows(tokens, arrays)
    try:
        seqs = together(bounded, lambda: [submit(bounded, c, ims, ad, logit_bias=tuple(no_eos.items()))
                                          for c, ims, ad in cases])
        got = bounded.wait(seqs, timeout=300)
    finally:
        bounded.stop()
    preempted = sum(s.num_preemptions for s in seqs)
    assert preempted >= 1
    if prompt_cache_bytes == 0:  # nothing kept: each preempted row's tower ran again, over its prompt and output
        assert len(towers) == len(cases) + preempted and max(map(len, towers)) > longest
    assert got == [reference(model, {"a": a, "b": b, None: None}[ad], c, ims, max_tokens=num, logit_bias=no_eos)
                   for c, ims, ad in cases]
