"""LoRA on mixture-of-experts bases, end to end through the engine: greedy
tokens and top-5 log-probabilities equal plain mlx-lm with each adapter
merged into the base weights (experts per expert), for each row alone and
all rows in one mixed batch (base rows, attention-only adapters, expert
adapters of different ranks, a per-request scale)."""

from __future__ import annotations

import math

import pytest

from helpers.engines import EngineRunner
from helpers.references import merged_model, reference_decode
from mola.testing.adapter import make_mlx_lm_lora
from mola.testing.model import TinyModelSpec, make_tiny_model

MAX_TOKENS = 10
TOP = 5
MARGIN = 1e-3  # compare tokens while the reference's top-2 gap is at least this
QUESTIONS = ["hello there, how are you?", "the quick brown fox jumps over the lazy dog " * 3]

# Where each architecture's mlx-lm port keeps its experts (a SwitchGLU).
EXPERTS = {"qwen3_moe": "mlp.switch_mlp", "qwen2_moe": "mlp.switch_mlp",
           "mixtral": "block_sparse_moe.switch_mlp", "gpt_oss": "mlp.experts"}


def expert_keys(model_type: str) -> tuple[str, ...]:
    return tuple(f"{EXPERTS[model_type]}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def build(root, model_type: str, **spec):
    model = make_tiny_model(root / "model", TinyModelSpec(model_type=model_type, **spec))
    adapters = {  # written by mlx-lm's own linear_to_lora_layers
        "full": make_mlx_lm_lora(root / "full", model, rank=4, seed=1),  # mlx-lm's default keys
        "experts8": make_mlx_lm_lora(root / "experts8", model, rank=8, keys=expert_keys(model_type), seed=2),
        "attn": make_mlx_lm_lora(root / "attn", model, rank=2, keys=("self_attn.q_proj", "self_attn.v_proj"),
                                 seed=3),
    }
    return model, adapters


# (adapter or None, lora_scale) of each row of the mixed batch.
ROWS = [(None, 1.0), ("full", 1.0), ("experts8", 1.0), ("attn", 1.0), ("full", 0.5), (None, 1.0)]


def compare(got_tokens, got_lps, ref_tokens, ref_lps, what: str) -> None:
    for step, (token, (lp, top)) in enumerate(zip(ref_tokens, ref_lps)):
        assert got_tokens[step] == token, f"{what}: token {step} differs"
        g_lp, g_top = got_lps[step]
        assert math.isclose(g_lp, lp, abs_tol=1e-3), (what, step, g_lp, lp)
        assert [t for t, _ in g_top] == [t for t, _ in top], (what, step)
        assert all(math.isclose(a, b, abs_tol=1e-3) for (_, a), (_, b) in zip(g_top, top)), (what, step)
        if top[0][1] - top[1][1] < MARGIN:
            break  # a near tie: later tokens may rightly differ


def references(model_dir, adapters, prompts, rows, dequantize=False):
    out = {}
    for name, scale in {r for r in rows}:
        model, _ = merged_model(model_dir, [adapters[name]] if name else [], [scale] if name else None,
                                dequantize=dequantize)
        for i, prompt in enumerate(prompts):
            out[(name, scale, i)] = reference_decode(model, prompt, MAX_TOKENS, top_k=TOP)
    return out


def run_mixed(runner, prompts, rows):
    seqs = [(key, i, runner.submit(p, key[0], lora_scale=key[1], logprobs=TOP))
            for i, p in enumerate(prompts) for key in rows]
    runner.wait([s for _, _, s in seqs])
    return [(key, i, s.output, runner.logprobs[s.seq_id]) for key, i, s in seqs]


@pytest.mark.parametrize("model_type", list(EXPERTS))
def test_expert_lora_equals_merged_weights_alone_and_mixed(tmp_path, model_type):
    model, adapters = build(tmp_path, model_type)
    runner = EngineRunner(model, max_tokens=MAX_TOKENS, max_loras=4, max_lora_rank=8, expert_slots=2,
                          max_expert_rank=8)
    try:
        for name in ("full", "experts8", "attn"):  # slots 1, 2 (expert slots) and 3
            runner.add(name, runner.read(adapters[name]))
        prompts = [runner.prompt(q) for q in QUESTIONS]
        assert len(prompts[1]) * 2 >= 64  # its prefill takes the sorted (token, expert) path
        refs = references(model, adapters, prompts, ROWS)
        assert refs[("full", 1.0, 0)][0] != refs[(None, 1.0, 0)][0]  # the adapters change the answer
        assert refs[("experts8", 1.0, 0)][0] != refs[(None, 1.0, 0)][0]
        for (name, scale), i, tokens, lps in run_mixed(runner, prompts, ROWS):
            compare(tokens, lps, *refs[(name, scale, i)], f"{model_type} mixed {name}*{scale} prompt {i}")
        for name, scale in {r for r in ROWS}:  # each alone
            seq = runner.submit(prompts[0], name, lora_scale=scale, logprobs=TOP)
            runner.wait([seq])
            compare(seq.output, runner.logprobs[seq.seq_id], *refs[(name, scale, 0)],
                    f"{model_type} alone {name}*{scale}")
    finally:
        runner.stop()


def test_quantized_moe_base_equals_its_dequantized_weights(tmp_path):
    model, adapters = build(tmp_path, "qwen3_moe", quantize_bits=8, quantize_group_size=32)
    runner = EngineRunner(model, max_tokens=MAX_TOKENS, max_loras=3, max_lora_rank=8, expert_slots=2,
                          max_expert_rank=8)
    try:
        layer = runner.engine.call(lambda: runner.engine.packs.layers).result()
        assert type(layer["model.layers.0.mlp.switch_mlp.up_proj"].base).__name__ == "QuantizedSwitchLinear"
        for name in ("full", "experts8"):
            runner.add(name, runner.read(adapters[name]))
        prompts = [runner.prompt(q) for q in QUESTIONS]
        rows = [(None, 1.0), ("full", 1.0), ("experts8", 1.0)]
        refs = references(model, adapters, prompts, rows, dequantize=True)
        for (name, scale), i, tokens, lps in run_mixed(runner, prompts, rows):
            compare(tokens, lps, *refs[(name, scale, i)], f"quantized {name} prompt {i}")
    finally:
        runner.stop()


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_peft_twins_of_an_expert_adapter_serve_its_answers_in_one_batch(tmp_path, model_type):
    """PEFT's per-expert linears (transformers 4) and fused target_parameters
    (transformers 5, gpt-oss), written from an mlx-lm adapter, give its tokens
    and log-probabilities, all three in one mixed batch."""
    from mola.adapters.formats import read_adapter
    from mola.testing.peft import save_peft_expert_params_adapter, save_peft_per_expert_adapter

    model, adapters = build(tmp_path, model_type)
    source = read_adapter(adapters["full"])
    twins = {"fused": save_peft_expert_params_adapter(tmp_path / "fused", source, model_type)}
    if model_type != "gpt_oss":  # transformers never had gpt-oss experts as one linear each
        twins["per_expert"] = save_peft_per_expert_adapter(tmp_path / "per-expert", source, model_type)
    runner = EngineRunner(model, max_tokens=MAX_TOKENS, max_loras=3, max_lora_rank=8, expert_slots=3,
                          max_expert_rank=8)  # the fused twin stacks gate and up's A: rank 2r
    try:
        runner.add("full", runner.read(adapters["full"]))
        for name, path in twins.items():
            runner.add(name, runner.read(path))
        prompts = [runner.prompt(q) for q in QUESTIONS]
        refs = references(model, adapters, prompts, [("full", 1.0)])
        rows = [("full", 1.0)] + [(name, 1.0) for name in twins] + [(None, 1.0)]
        for (name, _), i, tokens, lps in run_mixed(runner, prompts, rows):
            if name is not None:
                compare(tokens, lps, *refs[("full", 1.0, i)], f"{model_type} {name} prompt {i}")
    finally:
        runner.stop()


@pytest.mark.parametrize("model_type, arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_gguf_moe_base_with_gguf_expert_lora_equals_merged_weights(tmp_path, model_type, arch):
    """A GGUF MoE base (llama.cpp's layout) serving a GGUF expert LoRA and its
    mlx-lm twin in one batch: each equals mlx-lm on the mlx-lm directory with
    the LoRA merged."""
    import json

    from mola.adapters.formats import read_adapter
    from mola.adapters.formats.gguf_writer import save_gguf_adapter
    from mola.testing.gguf_model import save_gguf_model

    model, adapters = build(tmp_path, model_type)
    config = json.loads((model / "config.json").read_text())
    base = save_gguf_model(tmp_path / "base.gguf", model)
    lora = save_gguf_adapter(tmp_path / "full.gguf", read_adapter(adapters["full"]), architecture=arch,
                             n_head=config["num_attention_heads"], n_kv_head=config["num_key_value_heads"])
    runner = EngineRunner(base, max_tokens=MAX_TOKENS, max_loras=3, max_lora_rank=8, expert_slots=2,
                          max_expert_rank=8)
    try:
        runner.add("gguf", runner.read(lora))
        runner.add("mlx", runner.read(adapters["full"]))
        prompts = [runner.prompt(q) for q in QUESTIONS]
        refs = references(model, adapters, prompts, [("full", 1.0), (None, 1.0)])
        for (name, _), i, tokens, lps in run_mixed(runner, prompts, [("gguf", 1.0), ("mlx", 1.0), (None, 1.0)]):
            compare(tokens, lps, *refs[("full" if name else None, 1.0, i)], f"{model_type} {name} prompt {i}")
    finally:
        runner.stop()


def test_expert_packs_follow_the_loads_with_the_outputs_of_packs_at_the_ceilings(tmp_path):
    """Expert packs hold nothing until an adapter with expert LoRA loads, take
    its rank (a power of two under --max-expert-lora-rank), grow for a larger
    one and shrink back after it is cleared; a mixed batch gives, bit for bit,
    what packs held at the ceilings give."""
    from helpers.engines import hold_packs_at_ceilings

    model, adapters = build(tmp_path, "qwen3_moe")
    rows = [(None, 1.0), ("full", 1.0), ("experts8", 1.0), ("attn", 0.5)]

    def run(at_ceilings: bool):
        runner = EngineRunner(model, max_tokens=MAX_TOKENS, max_loras=4, max_lora_rank=8, expert_slots=2,
                              max_expert_rank=16)
        engine = runner.engine
        stats = lambda: engine.call(lambda: engine.packs.stats()).result()  # noqa: E731
        try:
            if at_ceilings:
                engine.call(lambda: hold_packs_at_ceilings(engine.packs)).result()
            prompts = [runner.prompt(q) for q in QUESTIONS]
            seen = [stats()]
            runner.slots.update(full=1, experts8=2, attn=3)  # expert slots 1..2
            for name in ("attn", "full", "experts8"):
                runner.add(name, runner.read(adapters[name]))
                seen.append(stats())
            mixed = run_mixed(runner, prompts, rows)
            engine.call(lambda: engine.clear_slot(runner.slots["experts8"])).result()
            engine.call(lambda: engine.packs.compact()).result()
            seen.append(stats())
            after = run_mixed(runner, prompts, rows[:2] + rows[3:])
            return [(k, i, t, lp) for k, i, t, lp in mixed + after], seen
        finally:
            runner.stop()

    sized, seen = run(False)
    ceiling, _ = run(True)
    assert sized == ceiling
    start, attn, full, experts8, cleared = seen
    assert start.nbytes == 0 and attn.expert_bytes == 0 and attn.dense_bytes > 0  # attention only: no expert pack
    assert full.expert_bytes > 0 and experts8.expert_bytes == 2 * full.expert_bytes  # rank 4, then 8
    assert cleared.expert_bytes == full.expert_bytes
