"""Test helpers, by area:

    vision.py       Images in chat: PIL-made image files, a PNG whose header lies, data URLs; mlx-vlm skipped or required (MOLA_REQUIRE_VISION=1).
    vision_models.py  Tiny random vision-language models (Qwen2-VL, Qwen2.5-VL, Idefics3) and mlx-vlm-trained-format adapters, built offline; mlx-vlm's own answers with adapters fused.
    servers.py      A real server in a thread (start_server), `mola serve` in a process of its own, and waiting on them.
    references.py   References computed another way: plain mlx-lm on merged weights, greedy and penalised decodes, grammar walks.
    schemas.py      OpenAI's schemas: responses and stream events validated against the official spec (tests/data/openai_schemas.json).
    engines.py      An engine without the server: EngineRunner, the registry on an engine, and the gate that makes a batch.
    tokenizers.py   Tokenizers of other model families: chat templates and added tokens on the tiny model's.
    blas.py         OpenBLAS for the test process (loaded before MLX, as mola serve runs; MOLA_OPENBLAS=0: the reference BLAS).
    startups.py     MOLA_COUNT_STARTS=1: the engines and subprocesses each test file starts (a pytest plugin).
"""
