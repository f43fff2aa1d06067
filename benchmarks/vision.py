"""Vision-language bases (issue 46): decode through the engine with image rows
of mixed adapters against image rows of one adapter, and what one image adds
to a prefill.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/vision.py [ROUNDS]

The model: a tiny random Qwen2-VL built offline (tests/helpers/vision_models.py),
its decoder 256 wide and 4 layers deep, images resized to 64 x 64 pixels at most
(64 vision tokens each); 4 adapters written by mlx-vlm's own trainer code
(get_peft_model, save_adapter), rank 8 on every decoder linear, in slots 1-4.

decode: the in-process Engine (scheduler, runner, layers: the whole step but
HTTP). A workload sends C=8 chat requests at once, each with its own image and
40 new tokens, greedy: "mixed" spreads them over the 4 adapters, "one" puts
them all on adapter 1. The figure is C over the median gap between two steps'
outputs while all C rows decode. Workloads alternate within a round (the order
flips each round) and ratios are taken within a round.

traffic: 16 requests with an image each, over the 4 adapters in turn (a, b,
c, d, a, ...), 40 new tokens each: mola's engine takes them all at once; the
way mlx-vlm's server serves them (its get_cached_model reloads the model with
the new adapter_path whenever a request names another adapter, then its
generate) is run in process, request by request, since its server cannot start
here (it imports mlx_audio, which the vision install leaves out). Wall time of
all 16 and output tokens per second, median of ROUNDS.

prefill: one request alone, max_tokens 1, with one image (its prompt of L
tokens, 64 of them vision tokens) against a text-only prompt of the same L
tokens: time to its one token, median of ROUNDS each, alternating; and the
vision part alone (the tower, the merge and the positions: image_rows) timed
on the engine thread.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
C, MAXTOK = 8, 40


def setup(root: Path):
    from helpers.vision_models import make_tiny_qwen2_vl, make_vlm_adapter

    model = make_tiny_qwen2_vl(root / "model", hidden=256, layers=4, max_pixels=64 * 64)
    keys = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = [make_vlm_adapter(root / f"a{i}", model, rank=8, seed=i, keys=keys, gain=0.05) for i in range(4)]
    return model, adapters


def main() -> None:
    from helpers.engines import EngineRunner
    from helpers.vision_models import image_chat, image_input

    from mola.engine.sequence import SamplingParams, Sequence
    from mola.frontend.vision_prompt import encode_vision_prompt

    root = Path(tempfile.mkdtemp())
    model, adapters = setup(root)
    runner = EngineRunner(model, [(f"a{i}", p) for i, p in enumerate(adapters)], max_tokens=MAXTOK,
                          max_num_seqs=16, max_lora_rank=8)
    eng, loaded = runner.engine, runner.loaded
    stamps, cond = [], threading.Condition()
    on_outputs = runner._on_outputs

    def on_out(outs):  # the runner's bookkeeping, and a stamp per step with tokens
        now = time.perf_counter()
        on_outputs(outs)
        with cond:
            if any(o.tokens for o in outs):
                stamps.append((now, sum(o.finish_reason is not None for o in outs)))
            cond.notify_all()

    eng.on_outputs = on_out  # (the engine calls this attribute)
    rng = random.Random(1)

    def prompt(seed):
        im = image_input(seed, (64, 64))
        chat = image_chat("Describe what you see in this picture.")
        chat[0]["content"][0]["image"] = im
        return encode_vision_prompt(loaded.processor, chat, loaded.model.image_token_id)

    def run(kind: str) -> float:
        stamps.clear()
        for i in range(C):
            ids, vision = prompt(rng.randrange(10**6))
            slot = runner.slots[f"a{i % 4}" if kind == "mixed" else "a0"]
            eng.add(Sequence(prompt=ids, params=SamplingParams(max_tokens=MAXTOK, temperature=0.0), slot=slot,
                             vision=vision))
        with cond:
            cond.wait_for(lambda: sum(f for _, f in stamps) >= C, 1200)
        t = [s for s, _ in stamps]
        gaps = [b - a for a, b in zip(t[5:-3], t[6:-2])]  # steady: all rows decoding
        return C / statistics.median(gaps)

    def first_token(with_image: bool) -> float:
        ids, vision = prompt(rng.randrange(10**6))
        if not with_image:
            ids, vision = [rng.randrange(100, 400) for _ in ids], None
        stamps.clear()
        t0 = time.perf_counter()
        eng.add(Sequence(prompt=ids, params=SamplingParams(max_tokens=1, temperature=0.0), slot=1, vision=vision))
        with cond:
            cond.wait_for(lambda: stamps, 600)
        return stamps[0][0] - t0

    def traffic_mola() -> float:
        stamps.clear()
        t0 = time.perf_counter()
        for i in range(16):
            ids, vision = prompt(1000 + i)
            eng.add(Sequence(prompt=ids, params=SamplingParams(max_tokens=MAXTOK, temperature=0.0),
                             slot=runner.slots[f"a{i % 4}"], vision=vision))
        with cond:
            cond.wait_for(lambda: sum(f for _, f in stamps) >= 16, 1200)
        return time.perf_counter() - t0

    def traffic_mlx_vlm() -> tuple[float, int]:
        from mlx_vlm import generate, load

        t0, loaded_adapter, m, proc, tokens = time.perf_counter(), None, None, None, 0
        for i in range(16):
            if m is None or loaded_adapter != adapters[i % 4]:  # a reload at each change, as its server does
                loaded_adapter = adapters[i % 4]
                m, proc = load(str(model), adapter_path=str(loaded_adapter))
            chat = image_chat("Describe what you see in this picture.")
            text = proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            out = generate(m, proc, text, image=[image_input(1000 + i, (64, 64)).image], max_tokens=MAXTOK,
                           temperature=0.0, verbose=False)
            tokens += out.generation_tokens
        return time.perf_counter() - t0, tokens

    out = {"rounds": ROUNDS, "c": C, "max_tokens": MAXTOK, "load_average_before": os.getloadavg()}
    try:
        traffic, n = {"mola": [], "mlx-vlm": []}, 0
        for r in range(ROUNDS):
            traffic["mola"].append(traffic_mola())
            t, n = traffic_mlx_vlm()  # the same greedy tokens as mola's (tests/test_vision_rows.py)
            traffic["mlx-vlm"].append(t)
        t_mola, t_vlm = (statistics.median(traffic[k]) for k in ("mola", "mlx-vlm"))
        print(f"traffic, 16 image requests over 4 adapters in turn, {n} tokens in all: mola {t_mola:.2f} s "
              f"({n / t_mola:.0f} tok/s), mlx-vlm reloading at each change {t_vlm:.2f} s "
              f"({n / t_vlm:.0f} tok/s): {t_vlm / t_mola:.1f}x", flush=True)
        out["traffic"] = {"requests": 16, "adapters": 4, "tokens": n, "mola_s": traffic["mola"],
                          "mlx_vlm_reload_s": traffic["mlx-vlm"], "mola_median_s": t_mola,
                          "mlx_vlm_median_s": t_vlm, "mlx_vlm_over_mola": t_vlm / t_mola}
        run("mixed"), run("one")  # warm-up
        res = {"mixed": [], "one": []}
        for r in range(ROUNDS):
            for kind in (("mixed", "one") if r % 2 == 0 else ("one", "mixed")):
                res[kind].append(run(kind))
        ratios = [m / o for m, o in zip(res["mixed"], res["one"])]
        print(f"decode c={C}, image rows: mixed over 4 adapters {statistics.median(res['mixed']):.1f} tok/s, "
              f"one adapter {statistics.median(res['one']):.1f} tok/s, mixed/one {statistics.median(ratios):.3f} "
              f"(each round: {[round(x, 3) for x in ratios]})", flush=True)
        out["decode"] = {"mixed_tok_s": res["mixed"], "one_tok_s": res["one"], "ratios": ratios,
                         "mixed_over_one_median": statistics.median(ratios)}
        ids, vision = prompt(0)
        times = {True: [], False: []}
        for r in range(ROUNDS + 1):
            for w in ((True, False) if r % 2 == 0 else (False, True)):
                t = first_token(w)
                if r:
                    times[w].append(t)
        tower = []
        for _ in range(ROUNDS):
            def timed():
                import mlx.core as mx

                t0 = time.perf_counter()
                out = loaded.model.image_rows(ids[:-1], {k: mx.array(a) for k, a in vision.arrays.items()})
                mx.eval(out[0])
                return time.perf_counter() - t0
            tower.append(eng.call(timed).result())
        img, txt = (statistics.median(times[k]) * 1e3 for k in (True, False))
        print(f"prefill of {len(ids)} tokens ({vision.num_image_tokens} of one image's): with the image "
              f"{img:.1f} ms to the first token, text-only {txt:.1f} ms (+{img - txt:.1f} ms); the vision part "
              f"alone (tower, merge, positions) {statistics.median(tower) * 1e3:.1f} ms", flush=True)
        out["prefill"] = {"prompt_tokens": len(ids), "vision_tokens": vision.num_image_tokens,
                          "with_image_ms": img, "text_only_ms": txt, "vision_part_ms": statistics.median(tower) * 1e3}
        out["load_average_after"] = os.getloadavg()
        path = Path(__file__).resolve().parent / "results" / "vision.json"
        path.write_text(json.dumps(out, indent=1))
    finally:
        runner.stop()


if __name__ == "__main__":
    main()
