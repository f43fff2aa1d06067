"""Images: POST /v1/images/generations on a resident FLUX.2-klein base (mflux), each
request's LoRA applied unmerged, per row of one batched denoising loop.

    request.py   what a request asks for, checked (sizes, steps, n, LoRA fields): plain Python
    lora.py      mola's MultiLoRALinear on a diffusion transformer (per-row LoRA, as mflux computes it)
    adapters.py  reading a LoRA file into factors through mflux's own loader; LoKr, DoRA, .diff refused
    base.py      loading the mflux model directory, its linears wrapped
    generate.py  the batched copy of mflux's Flux2Klein.generate_image
    worker.py    the one thread that owns the model: queue -> batch -> slots -> generate -> PNGs
    service.py   the event loop's side: names and paths -> a request on the worker's queue, a future back

mflux (pinned 0.24.0, installed with --no-deps: docs/images.md) is imported by
base.py, adapters.py, lora.py and generate.py only, and only on the worker thread's
first use: importing this package needs nothing beyond mola's own dependencies.
"""
