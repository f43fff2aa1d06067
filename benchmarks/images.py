"""Images per minute with mixed LoRAs against one LoRA (docs/images.md).

    python benchmarks/images.py [--model DIR --lora A.safetensors --lora B.safetensors ...]
                                [--size 512] [--steps 4] [--batch 4] [--rounds 3] [--dtype bfloat16]

The image worker (mola/images/worker.py) gets ``batch`` requests at once, each
one image: first all on one LoRA, then each on a LoRA of its own (cycling over
the files given), so that every batch mixes them. Both run unmerged on the same
resident base in one denoising loop per batch; the ratio says what per-row
routing costs over a batch that shares one LoRA. The first round of each is a
warm-up (compiles, reads the files) and is not counted.

With no --model it builds the tiny random FLUX.2-klein of mola.testing.images and
four random LoRAs, float32 at 64x64 (a CPU figure for a toy model: the transformer
is 32 wide, so the text encoder and the VAE dominate; run it with a real
FLUX.2-klein on a Mac or GPU for a figure that means anything).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mola.images.request import ImageJob, LoRAUse
from mola.images.worker import ImageWorker

PROMPTS = ["a photo of a cat", "a red fox in the snow", "a watercolor city at night", "a lighthouse at dawn"]


def tiny_setup(root: Path, num_loras: int) -> tuple[str, list[str]]:
    from mola.testing.images import build_tiny_image_model, load_reference, write_lora

    model = build_tiny_image_model(root / "tiny-flux")
    transformer = load_reference(model).transformer
    loras = [str(write_lora(root / f"l{i}.safetensors", transformer, rank=4 + 4 * i, seed=i)) for i in range(num_loras)]
    return str(model), loras


def images_per_minute(worker: ImageWorker, loras: list[str], args) -> float:
    """Rounds of ``batch`` one-image requests (request i on loras[i % len]), the first not counted."""
    seconds = 0.0
    for round_ in range(args.rounds + 1):
        jobs = [ImageJob(PROMPTS[i % len(PROMPTS)], 1000 * round_ + i, args.size, args.size, args.steps,
                         (LoRAUse(loras[i % len(loras)], 1.0),)) for i in range(args.batch)]
        t0 = time.perf_counter()
        futures = [worker.submit([job]) for job in jobs]
        for f in futures:
            f.result()
        if round_:
            seconds += time.perf_counter() - t0
    return 60.0 * args.batch * args.rounds / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an mflux FLUX.2-klein directory (default: the tiny random one)")
    ap.add_argument("--lora", action="append", default=[], help="a LoRA file (repeatable; default: 4 random)")
    ap.add_argument("--size", type=int, default=None, help="image side (default 512; 64 for the tiny model)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 for the tiny model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.model is None
        model, loras = tiny_setup(Path(tmp), max(args.batch, 2)) if tiny else (args.model, args.lora)
        if len(loras) < 2:
            ap.error("give at least two --lora files with --model")
        args.size = args.size or (64 if tiny else 512)
        dtype = args.dtype or ("float32" if tiny else "bfloat16")
        worker = ImageWorker(model, dtype, max_batch=args.batch, max_rank=64)
        worker.start()
        try:
            one = images_per_minute(worker, loras[:1], args)
            mixed = images_per_minute(worker, loras, args)
        finally:
            worker.stop()
    what = "tiny random model, CPU" if tiny else model
    print(f"{what}: {args.size}x{args.size}, {args.steps} steps, batches of {args.batch}, {dtype}")
    print(f"one LoRA:   {one:7.1f} images/min")
    print(f"mixed LoRA: {mixed:7.1f} images/min ({min(len(loras), args.batch)} LoRAs per batch)")
    print(f"mixed / one: {mixed / one:.2f}")
    if all(b == args.batch for b in worker.batch_rows):
        print(f"every batch held {args.batch} rows")
    else:
        print(f"batch rows: {worker.batch_rows}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
