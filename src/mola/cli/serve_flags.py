"""`mola serve`'s flags (each maps to the setting of the same name, mola.config.SETTINGS)."""

from __future__ import annotations

import argparse
import json

import os

from ..config import (DEMO_CHOICES, IMAGE_DTYPES, LOG_LEVELS, REASONING_PARSERS, AdapterSpec, ImageModelSpec, ModelSpec,
                      parse_bytes)
from ..engine.config import KV_ADMISSION_MODES, KV_BITS, KV_GROUP_SIZES
from ..models import DTYPE_CHOICES


def adapter_arg(value: str) -> AdapterSpec:
    """NAME=PATH -> AdapterSpec."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    try:
        return AdapterSpec(name.strip(), path.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


class ModelFlag(argparse.Action):
    """--model PATH (the default base) or --model NAME=PATH (a further base; repeatable)."""

    def __call__(self, parser, namespace, value, option_string=None):
        name, sep, path = value.partition("=")
        if not sep or "/" in name or os.path.exists(value):  # a path or hub id, '=' and all
            setattr(namespace, "model", value)
            return
        try:
            spec = ModelSpec(name.strip(), path.strip())
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e))
        setattr(namespace, "models", [*getattr(namespace, "models", []), spec])


def image_model_arg(value: str) -> ImageModelSpec:
    """NAME=PATH -> ImageModelSpec."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    try:
        return ImageModelSpec(name.strip(), path.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def size_arg(value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def kv_size_arg(value: str) -> int | None:
    """--kv-cache-bytes: a size, or auto (None)."""
    return None if value == "auto" else size_arg(value)


def add_serve_parser(commands) -> argparse.ArgumentParser:
    """`mola serve`: settings from defaults, then --config FILE, then the flags given."""
    serve = commands.add_parser(
        "serve", help="serve a base model and its adapters over an OpenAI-compatible API",
        description="Settings come from defaults, then --config FILE, then the flags given.",
        argument_default=argparse.SUPPRESS,
    )
    _model_flags(serve)
    _adapter_flags(serve)
    _engine_flags(serve)
    _access_flags(serve)
    _speculative_flags(serve)
    _image_flags(serve)
    _vision_flags(serve)
    return serve


def _model_flags(serve: argparse.ArgumentParser) -> None:
    """Which model, in what dtype, under what id."""
    serve.add_argument("--config", help="a TOML or YAML file declaring the model, adapters and settings")
    serve.add_argument("--model", action=ModelFlag, metavar="[NAME=]PATH",
                       help="base model: a local mlx-lm directory, a Hugging Face hub id, "
                       "or a llama.cpp GGUF file (or a directory holding one) "
                       "(default: the demo, SmolLM2-135M-Instruct with three adapters, fetched on "
                       "first run; offline, the echo demo). NAME=PATH declares a further base served "
                       "as model id NAME, loaded on its first request (repeatable; the first is the "
                       "default base when no plain --model is given)")
    serve.add_argument("--max-loaded-models", type=int, metavar="N",
                       help="bases loaded at once at most; loading another unloads the least recently "
                       "used idle one (default: no limit)")
    serve.add_argument("--models-memory-bytes", type=size_arg, metavar="SIZE",
                       help="the loaded bases' weights and slot packs within SIZE, e.g. 16GB (default: no limit)")
    serve.add_argument("--keep-alive", type=float, metavar="SECONDS",
                       help="unload a base idle this long (default: never; a [[models]] entry's "
                       "keep_alive wins); it loads again on its next request")
    serve.add_argument("--demo", choices=DEMO_CHOICES,
                       help="with no --model: chat (default; the echo demo when its model cannot be "
                       "fetched) or echo (a tiny base that echoes the message, built in seconds)")
    serve.add_argument("--served-model-name", help="the id clients use for the base model "
                       "(default: the model directory's name, or the GGUF file's name without .gguf)")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                       help="split a thinking model's reasoning from its answer (reasoning_content, "
                       "Responses reasoning items): auto picks from the chat template (default), "
                       "none leaves it in the content")
    serve.add_argument("--dtype", choices=DTYPE_CHOICES,
                       help="weights at load: keep (quantized layers stay quantized: of a GGUF file "
                       "Q4_0/1, Q5_0/1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL/XS, IQ3_S/XXS, IQ2_XXS, IQ1_S, "
                       "bit for bit; Q2_K and the other codecs are dequantized), float16, bfloat16 or "
                       "float32 (all dequantized); auto (default): GGUF files float32 on a CPU where that "
                       "fits in memory (else keep) and kept on a GPU, mlx-lm directories as they are")


def _adapter_flags(serve: argparse.ArgumentParser) -> None:
    """Where adapters may come from, and how many are kept where."""
    serve.add_argument("--adapter", dest="adapters", action="append", type=adapter_arg, metavar="NAME=PATH",
                       help="serve the adapter at PATH (a directory, .gguf file or hub id) as model "
                       "id NAME (repeatable)")
    serve.add_argument("--adapter-dir", dest="adapter_dirs", action="append", metavar="DIR",
                       help="every subdirectory or .gguf file of DIR is an adapter named after it, "
                       "loaded on first use (repeatable)")
    serve.add_argument("--allow-any-adapter-path", action="store_true",
                       help="let adapters load from any path, not only under --adapter-dir (or named at start)")
    serve.add_argument("--allow-adapter-symlinks", action="store_true",
                       help="follow symlinks inside an --adapter-dir wherever they lead (default: an "
                       "adapter's real path must lie under an --adapter-dir)")
    serve.add_argument("--adapter-resolver", dest="adapter_resolvers", action="append", metavar="SPEC",
                       help="where a model id no adapter has is looked for (repeatable, tried in "
                       "order; off by default): dir:PATH tries PATH/<id>; hf:ORG/* (or "
                       "hf:ORG/A,ORG/B) an ORG/NAME hub repo, through huggingface-hub's cache")


def _engine_flags(serve: argparse.ArgumentParser) -> None:
    """The address, the batch, the context and the prompt cache."""
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--max-loras", type=int, help="adapter slots, i.e. resident adapters (default 8)")
    serve.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default 64)")
    serve.add_argument("--max-expert-loras", type=int, metavar="N",
                       help="mixture-of-experts bases: how many of the slots can also carry LoRA on the "
                       "experts, each E times a dense slot's size (default 4, or --max-loras if fewer)")
    serve.add_argument("--max-expert-lora-rank", type=int, metavar="R",
                       help="largest adapter rank in the experts (default 16)")
    serve.add_argument("--max-cpu-loras", type=int, metavar="N",
                       help="keep up to N recently used adapters read and prepared in host memory, "
                       "so that loading one into a slot is only the copy (default: no host tier)")
    serve.add_argument("--adapter-cache-bytes", type=size_arg, metavar="SIZE",
                       help="cap the host tier's memory, e.g. 4GB or 512MiB (with or without "
                       "--max-cpu-loras; default: no host tier)")
    serve.add_argument("--max-adapter-wait", type=float, metavar="SECONDS",
                       help="a request that waited this long for its adapter's slot gets the next slot "
                       "that frees, ahead of busier adapters (default 2)")
    serve.add_argument("--max-num-seqs", type=int, help="rows in one decode batch (default 32)")
    serve.add_argument("--prefill-step-size", type=int,
                       help="prompt tokens prefilled per engine step (default 512)")
    serve.add_argument("--max-model-len", type=int, help="context limit (default: the model's own)")
    serve.add_argument("--prompt-cache-bytes", type=size_arg, metavar="SIZE",
                       help="KV state of earlier prompts and outputs kept for reuse, per adapter "
                       "(e.g. 512MB, 2GiB; default 1GiB; 0 turns the prompt cache off)")
    serve.add_argument("--kv-cache-bytes", type=kv_size_arg, metavar="SIZE",
                       help="what the running requests' KV caches may hold together, per base (e.g. 4GiB; "
                       "default auto: half the memory free after the model, its adapter slots and the "
                       "prompt cache, capped at --max-num-seqs full contexts; 0: no budget)")
    serve.add_argument("--kv-admission", choices=KV_ADMISSION_MODES,
                       help="optimistic (default): admit a request when its prompt fits the KV budget, and "
                       "preempt the youngest when the batch outgrows it (recomputed later, same output); "
                       "reserve: admit when its prompt and max_tokens fit, never preempt")
    serve.add_argument("--kv-bits", type=int, choices=KV_BITS,
                       help="quantize the KV cache's keys and values to 8 or 4 bits (mlx-lm's QuantizedKVCache; "
                       "counted in the KV budget; default: the model's dtype)")
    serve.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES,
                       help="values quantized together along the head dimension with --kv-bits (default 64)")


def _access_flags(serve: argparse.ArgumentParser) -> None:
    """Logs, BLAS, keys, limits and timeouts."""
    serve.add_argument("--log-level", choices=LOG_LEVELS)
    serve.add_argument("--no-openblas", action="store_true",
                       help="on Linux CPU, do not preload the system's OpenBLAS (see mola/blas.py)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route "
                       "(default: $MOLA_API_KEY)")
    serve.add_argument("--admin-key", help="require this key to load and unload adapters "
                       "(default: $MOLA_ADMIN_KEY)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="require the API key on /metrics and /health too")
    serve.add_argument("--no-ui", dest="ui", action="store_false",
                       help="do not serve the playground page at / (it is then a 404)")
    serve.add_argument("--max-request-bytes", type=int, metavar="N",
                       help="refuse request bodies larger than N bytes with a 413 (default 4 MiB)")
    serve.add_argument("--max-adapter-push-bytes", type=size_arg, metavar="SIZE",
                       help="the largest adapter PUT /v1/adapters/{name}/weights takes (default 1GiB)")
    serve.add_argument("--max-queue", type=int,
                       help="sequences waiting beyond the batch before 429s (default 256)")
    serve.add_argument("--max-stored-responses", type=int,
                       help="responses kept in memory for previous_response_id, least recently used "
                       "evicted first (default 1024)")
    serve.add_argument("--request-timeout", type=float,
                       help="seconds a request may run (or wait) before it ends (default: no limit)")
    serve.add_argument("--shutdown-timeout", type=float,
                       help="seconds running requests may take to finish on SIGTERM (default 30)")


def _speculative_flags(serve: argparse.ArgumentParser) -> None:
    """Distributed serving and speculative decoding."""
    serve.add_argument("--distributed", action="store_true",
                       help="shard the base over the ranks started by mlx.launch (see docs/distributed.md)")
    serve.add_argument("--replicas", type=int, metavar="N",
                       help="N replicas on Ray Serve, each with its own base and slots, requests routed to one "
                       "holding their adapter (the ray extra; docs/distributed.md, Replicas)")
    serve.add_argument("--ray-address", metavar="ADDR", help="--replicas: join this Ray cluster "
                       "(default: start a local one)")
    serve.add_argument("--autoscaling", type=json.loads, metavar="JSON", help="--replicas: Ray Serve's "
                       "autoscaling_config, e.g. '{\"min_replicas\": 1, \"max_replicas\": 4}' (replaces N)")
    serve.add_argument("--speculative", choices=["ngram", "draft"],
                       help="speculative decoding: ngram (prompt lookup: drafts copied from the prompt "
                       "and output so far) or draft (a --draft-model drafts); default off")
    serve.add_argument("--draft-model", help="--speculative draft: a small model with the same tokenizer "
                       "(a local directory or hub id); it runs without adapters")
    serve.add_argument("--num-draft-tokens", type=int, metavar="N",
                       help="most tokens a row drafts in one step (default 8)")
    serve.add_argument("--prompt-lookup-min", type=int, metavar="N",
                       help="shortest n-gram prompt lookup matches (default 2)")
    serve.add_argument("--prompt-lookup-max", type=int, metavar="N",
                       help="longest n-gram prompt lookup matches, tried first (default 4)")
    serve.add_argument("--speculative-max-batch", type=int, metavar="N",
                       help="steps with more decode rows than N do not speculate (default 8)")
    serve.add_argument("--speculate-always", action="store_true",
                       help="speculate whenever a row has a draft (default: only when the step costs "
                       "measured as the server runs say it pays)")


def _image_flags(serve: argparse.ArgumentParser) -> None:
    """POST /v1/images/generations on a resident diffusion base (docs/images.md)."""
    serve.add_argument("--image-model", type=image_model_arg, metavar="NAME=PATH",
                       help="serve images from the FLUX.2-klein model at PATH (an mflux directory) as model "
                       "id NAME; needs the images extra and mflux (docs/images.md)")
    serve.add_argument("--image-adapter", dest="image_adapters", action="append", type=adapter_arg,
                       metavar="NAME=PATH", help="an image LoRA (.safetensors) served as model id NAME on "
                       "/v1/images/generations (repeatable)")
    serve.add_argument("--image-dtype", choices=IMAGE_DTYPES,
                       help="the image model's compute dtype (default bfloat16, as mflux's)")
    serve.add_argument("--image-max-batch", type=int, metavar="N",
                       help="images denoised together in one batch, each with its own LoRA (default 4)")
    serve.add_argument("--image-max-lora-rank", type=int, metavar="R",
                       help="largest rank of an image LoRA, or of the LoRAs one request stacks (default 64)")


def _vision_flags(serve: argparse.ArgumentParser) -> None:
    """Images in chat requests, for a base that takes them (docs/vision.md)."""
    serve.add_argument("--allow-remote-images", action="store_true",
                       help="fetch http(s) image URLs in chat requests (default: refused with a 400; send "
                       "images inline as data: URLs or base64 blocks)")
    serve.add_argument("--max-image-bytes", type=size_arg, metavar="SIZE",
                       help="the largest image file a chat request may carry, e.g. 20MB (default 20MiB; "
                       "--max-request-bytes bounds the whole body too, and base64 takes 4/3 of the bytes)")
    serve.add_argument("--max-image-pixels", type=int, metavar="N",
                       help="the most pixels (width x height, read from the image's header before it is "
                       "decoded) of one image (default 40000000)")
    serve.add_argument("--max-images-per-request", type=int, metavar="N",
                       help="the most images one chat request may carry, over all its messages (default 16)")
    serve.add_argument("--max-vision-tokens", type=int, metavar="N",
                       help="the most vision tokens one chat request's images may take in the prompt "
                       "(default 16384; a vision base's processor decides each image's count)")
