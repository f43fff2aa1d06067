"""Build the embedded demo and write its adapters to adapters/demo/.

    python devtools/build_demo.py [--out adapters/demo] [--keep-data DIR] [--check N]

The base model is built by mola.synthetic.echo; each adapter is trained with
`mola train`'s own function (mola.train.train_adapter) on data from
mola.synthetic.demo_data (see mola/demo.py for the recipes). The build goes
to a temporary directory; the adapters and the SHA-256 of the base they were
trained on (base.sha256) then replace --out. The base itself is not kept
there: `mola serve` rebuilds it into its cache in seconds. On Linux, preload
OpenBLAS for speed (mola serve and mola train do it by themselves):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python devtools/build_demo.py

--check N greedily decodes N held-out messages with each model (plain mlx-lm,
no mola code) and reports how many come out exactly right.
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


def check(demo: Path, n: int, seed: int = 12345) -> bool:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mola.demo import BASE, DEMO_ADAPTERS, RECIPES
    from mola.synthetic import demo_data

    messages = demo_data.messages(n, seed)
    tasks = {"mola-demo": (None, lambda m: m)}
    tasks.update({a: (demo / a, demo_data.TASKS[RECIPES[a].task]) for a in DEMO_ADAPTERS})
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "adapters" / "demo")
    p.add_argument("--keep-data", type=Path, help="also write each adapter's train/valid data here")
    p.add_argument("--check", type=int, default=0, metavar="N", help="check N held-out messages per model")
    a = p.parse_args()

    from mola.demo import BASE, BASE_HASH_FILE, DEMO_ADAPTERS, base_hash, build_demo

    out = a.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".demo-build-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        build_demo(tmp, keep_data=a.keep_data)
        ok = check(tmp, a.check) if a.check else True
        done = tmp / "out"
        done.mkdir()
        for name in DEMO_ADAPTERS:
            os.replace(tmp / name, done / name)
        (done / BASE_HASH_FILE).write_text(base_hash(tmp / BASE) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(done, out)
    total = 0
    for f in sorted(out.rglob("*")):
        if f.is_file():
            total += f.stat().st_size
            print(f"{f.relative_to(out)}  {f.stat().st_size / 1024:.0f} KiB")
    print(f"built {out} in {time.perf_counter() - t0:.0f} s, {total / 1024:.0f} KiB in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
