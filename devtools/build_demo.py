"""Retrain the demo adapters and write them to adapters/.

    python devtools/build_demo.py [--demo chat|echo] [--out DIR] [--keep-data DIR] [--check N]

chat (default): SmolLM2-135M-Instruct (fetched into mola's cache, hashes
checked) and the adapters of mola/demo/chat.py, trained with `mola train`'s own
function on the base model's own answers to generated questions, rewritten
by each style's rule (mola/demo/styles.py); stored as float16 in
adapters/smollm2/ with the SHA-256 of the GGUF file they were trained on.
echo: the echo demo's adapters (mola/demo/echo.py) in adapters/echo/, with
the SHA-256 of the echo base (which is not kept: `mola serve` rebuilds it).

The build goes to a temporary directory outside the checkout that then replaces --out. It is
reproducible on one machine (greedy answers, seeded training); another CPU or
BLAS may round differently. On Linux, preload OpenBLAS for speed (mola serve
and mola train do it by themselves):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python devtools/build_demo.py

--check N greedily answers N held-out questions (messages, for echo) with the
base and each adapter and reports how many show the adapter's behaviour; the
exit status is 1 when one does not (or, for chat, when the base's does).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check_echo(demo: Path, n: int, seed: int = 12345) -> bool:
    """Exact answers of the echo base and adapters (plain mlx-lm, no mola code)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mola.demo.echo import BASE, DEMO_ADAPTERS, RECIPES
    from mola.demo import echo_data

    messages = echo_data.messages(n, seed)
    tasks = {"mola-demo": (None, lambda m: m)}
    tasks.update({a: (demo / a, echo_data.TASKS[RECIPES[a].task]) for a in DEMO_ADAPTERS})
    ok_all = True
    for name, (adapter, fn) in tasks.items():
        model, tok = load(str(demo / BASE), adapter_path=str(adapter) if adapter else None)
        right, wrong = 0, []
        for m in messages:
            prompt = tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
            out = []
            for t, _ in generate_step(mx.array(prompt), model, max_tokens=200, sampler=make_sampler(0.0)):
                if int(t) == tok.eos_token_id:
                    break
                out.append(int(t))
            answer = tok.decode(out)
            if answer == fn(m):
                right += 1
            else:
                wrong.append((m, fn(m), answer))
        print(f"{name:10s} {right}/{len(messages)} exact", flush=True)
        for m, want, got in wrong[:5]:
            print(f"    {m!r}: want {want!r}, got {got!r}")
        ok_all = ok_all and not wrong
    return ok_all


def check_chat(demo: Path, n: int, max_tokens: int = 64) -> bool:
    """Each adapter's greedy answers to held-out questions pass its style's
    check and no other's; the base's pass none (mlx-lm's LoRA layers on the
    GGUF base as mola loads it)."""
    from mlx_lm import batch_generate
    from mlx_lm.tuner.utils import load_adapters

    from mola.demo.chat import DEMO_ADAPTERS, NAME
    from mola.demo.questions import questions
    from mola.demo.styles import CHECKS
    from mola.models.fetch import ensure_smollm
    from mola.models.loader import load_base_model

    held_out = questions(held_out=True, seed=1)[:n]
    ok_all = True
    for name in (NAME, *DEMO_ADAPTERS):
        loaded = load_base_model(str(ensure_smollm()))
        model = loaded.model if name == NAME else load_adapters(loaded.model, str(demo / name))
        tok = loaded.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in held_out]
        answers = batch_generate(model, tok, prompts, max_tokens=max_tokens).texts
        passed = {style: sum(check(a) for a in answers) for style, check in CHECKS.items()}
        want = {style: (len(answers) if style == name else 0) for style in CHECKS}
        ok = passed == want
        ok_all = ok_all and ok
        print(f"{name:22s} passes " + ", ".join(f"{s} {k}/{len(answers)}" for s, k in passed.items())
              + ("" if ok else f"  (want {want})"), flush=True)
        for q, a in list(zip(held_out, answers))[:3]:
            print(f"    {q!r} -> {a!r}")
    return ok_all


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", choices=["chat", "echo"], default="chat")
    p.add_argument("--out", type=Path, help="default: adapters/smollm2 (chat) or adapters/echo")
    p.add_argument("--keep-data", type=Path, help="also write each adapter's train/valid data here")
    p.add_argument("--check", type=int, default=0, metavar="N", help="check N held-out questions per model")
    a = p.parse_args()

    from mola.demo import chat, echo

    out = (a.out or (chat.checkout_demo_dir() if a.demo == "chat" else echo.checkout_demo_dir())).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # Built outside the checkout (an interrupted build leaves nothing in it), then moved into place.
    with tempfile.TemporaryDirectory(prefix="mola-demo-build-") as tmp:
        tmp = Path(tmp)
        done = tmp / "out"
        if a.demo == "chat":
            from mola.models.fetch import ensure_smollm

            chat.build_demo(done, ensure_smollm(), keep_data=a.keep_data)
            ok = check_chat(done, a.check) if a.check else True
        else:
            echo.build_demo(tmp, keep_data=a.keep_data)
            ok = check_echo(tmp, a.check) if a.check else True
            done.mkdir()
            for name in echo.DEMO_ADAPTERS:
                os.replace(tmp / name, done / name)
            (done / echo.BASE_HASH_FILE).write_text(echo.base_hash(tmp / echo.BASE) + "\n")
        if out.exists():
            shutil.rmtree(out)
        shutil.move(done, out)
    total = 0
    for f in sorted(out.rglob("*")):
        if f.is_file():
            total += f.stat().st_size
            print(f"{f.relative_to(out)}  {f.stat().st_size / 1024:.0f} KiB")
    print(f"built {out} in {time.perf_counter() - t0:.0f} s, {total / 1024:.0f} KiB in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
