"""Loading the base model: an mlx-lm directory, a Hugging Face hub id, or a
llama.cpp GGUF file (or a directory holding one), in the dtype --dtype asks for."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import mlx.core as mx

from ..errors import ModelLoadError
from . import DTYPE_CHOICES
from .eog import end_of_generation_ids
from .gguf import DTYPES
from .metadata import find_gguf
from .model import LoadedModel
from .vision import vision_model_type

log = logging.getLogger("mola.loader")

__all__ = ["ModelLoadError", "load_base_model", "load_draft_model", "looks_like_hub_id", "resolve_model_path",
           "resolve_dtype"]

# What a model directory needs (mlx-lm downloads the same set).
MODEL_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]



def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory (or GGUF file) as is; otherwise a hub id through
    huggingface-hub's cache (downloading only if the hub is reachable)."""
    path = Path(model).expanduser()
    if path.exists():
        gguf = find_gguf(path)
        if gguf is not None:
            return gguf
        if path.is_file():
            raise ModelLoadError(f"{path} is a file but not a GGUF model (no GGUF magic); a model is "
                                 "a GGUF file or a directory with config.json")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory: it has no config.json (nor a .gguf file)")
        return path
    if not looks_like_hub_id(model):
        raise ModelLoadError(f"The model path does not exist: {path}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=MODEL_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ModelLoadError(
            f"Could not fetch '{model}' from the Hugging Face hub (nor find it in "
            f"the local cache): {type(e).__name__}: {e}"
        ) from e


def resolve_dtype(dtype: str, is_gguf: bool, tensors=None, free: int | None = None) -> str:
    """``auto`` -> what mola picks: for GGUF files on a CPU, dequantized float32 (MLX's
    quantized matmul is far slower there, see benchmarks/gguf_dtype.py) where it fits
    the ``free`` memory given the file's ``tensors`` (models/fit.py), else kept
    quantized; on a GPU kept quantized; mlx-lm directories as they are."""
    if dtype not in DTYPE_CHOICES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype != "auto":
        return dtype
    if is_gguf and mx.default_device() == mx.cpu:
        if tensors is None:
            return "float32"
        from .fit import auto_dtype

        return auto_dtype(tensors, free)
    return "keep"


def load_base_model(model: str, revision: str | None = None, group=None, dtype: str = "auto") -> LoadedModel:
    """Load model and tokenizer; with a distributed ``group``, this rank's
    tensor-parallel shard (mlx-lm's own sharding). Call on the engine thread."""
    path = resolve_model_path(model, revision)
    shard = f" (shard {group.rank() + 1} of {group.size()})" if group else ""
    t0 = time.perf_counter()
    if path.is_file():
        loaded = _load_gguf(path, dtype, group, shard)
    else:
        dtype = resolve_dtype(dtype, False)
        log.info("loading model from %s (dtype %s)%s", path, dtype, shard)
        vision = vision_model_type(path)
        if vision is not None and importlib.util.find_spec("mlx_vlm") is None:
            log.warning("%s is a vision model ('%s'), but mlx-vlm is not installed: serving its language model "
                        "alone, through mlx-lm, and refusing images (pip install 'mola[vision]' and mlx-vlm: "
                        "docs/vision.md)", path, vision)
            vision = None
        loaded = _load_mlx_lm(path, dtype, group) if vision is None else _load_vision(path, vision, dtype, group)
    # Where the model ends: one rule for every source (models/eog.py).
    loaded.tokenizer.eos_token_ids = end_of_generation_ids(loaded.tokenizer, path)
    log.info("model loaded in %.1f s; generation ends at tokens %s", time.perf_counter() - t0,
             sorted(loaded.tokenizer.eos_token_ids))
    return loaded


def check_gguf(f, dtype: str, free: int | None):
    """(the --dtype ``dtype`` resolves to, its MemoryPlan) for an opened GGUF file,
    before any tensor is read: ModelLoadError naming a codec mola cannot read, or
    memory the model would not fit in (models/fit.py)."""
    from . import fit

    tensors = f.reader.tensors
    unreadable = fit.unreadable_codecs(tensors)
    if unreadable:
        codec, name = next(iter(unreadable.items()))
        raise ModelLoadError(
            f"{f.path} stores tensor '{name}' as {codec}, which mola cannot read "
            f"({', '.join(sorted(unreadable))} in all); it keeps {', '.join(fit.KEPT)} quantized, reads "
            f"{', '.join(fit.FLOATS)} as they are and dequantizes the other codecs gguf-py reads "
            "(Q2_K, IQ2_XS, IQ2_S, IQ1_M, TQ1_0, TQ2_0, MXFP4, NVFP4).")
    dtype = resolve_dtype(dtype, True, tensors, free)
    need = fit.plan(tensors, dtype)
    fit.check_fits(f.path, need, free, None if dtype == "keep" else fit.plan(tensors, "keep"))
    return dtype, need


def _load_gguf(path: Path, dtype: str, group, shard: str = "") -> LoadedModel:
    from .fit import free_bytes, gib
    from .gguf_cache import ConversionCache
    from .gguf_file import open_gguf
    from .gguf_load import load_gguf

    try:
        cache = ConversionCache.from_env()
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    f = open_gguf(path)
    dtype, need = check_gguf(f, dtype, None if group else free_bytes())
    log.info("loading model from %s (dtype %s, computing in %s)%s: %s by tensor group", path, dtype,
             need.compute, shard, gib(need.total))
    for line in need.lines():
        log.info("  %s", line)
    model, config, tokenizer = load_gguf(f, dtype, cache)
    if group is not None:
        _shard(model, group, path)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)


def _shard(model, group, path: Path) -> None:
    from .quantized_pair import QuantizedPairEmbedding, QuantizedPairLinear

    pairs = [p for p, m in model.named_modules() if isinstance(m, (QuantizedPairLinear, QuantizedPairEmbedding))]
    if pairs:  # mlx's sharded layers would take the low half alone
        raise ModelLoadError(
            f"{path}: {len(pairs)} Q6_K matrices ({pairs[0]}, ...) are kept as pairs of quantized halves, "
            "which tensor parallelism cannot cut; serve it with --distributed and --dtype float16 or float32")
    if not hasattr(model, "shard"):
        raise ModelLoadError(f"mlx-lm's {type(model).__module__} model has no tensor-parallel sharding")
    model.shard(group)
    mx.eval(model.parameters())


def _check_config_json(path: Path) -> None:
    """A directory's config.json, read before mlx-lm does, so that a broken one is named."""
    import json

    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no config.json: it is not an mlx-lm model directory")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file} is not a JSON object")


def _load_mlx_lm(path: Path, dtype: str, group) -> LoadedModel:
    from mlx_lm.utils import dequantize_model, load, sharded_load

    if path.is_dir():
        _check_config_json(path)
    try:
        if group is not None:
            model, tokenizer, config = sharded_load(
                str(path), tensor_group=group, return_config=True,
                tokenizer_config={"trust_remote_code": False},
            )
        else:
            model, tokenizer, config = load(str(path), return_config=True)
    except Exception as e:
        raise ModelLoadError(f"mlx-lm could not load the model at {path}: {e}") from e
    if dtype != "keep":
        if group is not None and "quantization" in config:
            raise ModelLoadError(f"--dtype {dtype} with --distributed: mola does not dequantize a "
                                 "sharded quantized model; use --dtype keep or a float model")
        dequantize_model(model)
        model.set_dtype(DTYPES[dtype])
        mx.eval(model.parameters())
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    if config.get("model_type") == "gemma2":  # mlx-lm's gemma2 cannot take a batch's mask as it is
        from .gguf_arch.gemma import batched_masks

        batched_masks(model, config)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)


def _load_vision(path: Path, model_type: str, dtype: str, group) -> LoadedModel:
    """An mlx-vlm model directory, through mlx-vlm's loader (mola.models.vision);
    its text tokenizer as mlx-lm wraps it, for the text path."""
    from mlx_lm.utils import load_tokenizer

    from .vision import load_vision_model

    if group is not None:
        raise ModelLoadError(f"{path} is a vision model; mola does not shard one over --distributed")
    if dtype not in ("keep", "auto"):
        raise ModelLoadError(f"--dtype {dtype}: mola serves a vision model ({path}) in its own dtype; "
                             "use --dtype keep")
    model, processor, config = load_vision_model(path, model_type)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, processor=processor,
                       takes_images=True)


def load_draft_model(model: str, target: LoadedModel, revision: str | None = None,
                     dtype: str = "auto") -> LoadedModel:
    """The draft model of --speculative draft, which must tokenize as the
    target does (its drafts are token ids the target verifies)."""
    draft = load_base_model(model, revision, dtype=dtype)
    mine, theirs = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        raise ModelLoadError(
            f"The draft model {draft.path} does not have the tokenizer of the model {target.path}: "
            f"their vocabularies differ ({len(mine)} and {len(theirs)} tokens, {differ} entries not in "
            f"both); --draft-model needs a model with the same tokenizer")
    return draft


def base_loader(model: str, dtype: str = "auto", draft_model: str | None = None, group=None):
    """What an engine (or a follower) loads, on its own thread: the base model
    (this rank's shard of it in a group), and beside it the whole draft
    model, if any."""

    def load() -> LoadedModel:
        loaded = load_base_model(model, group=group, dtype=dtype)
        if draft_model is not None:
            loaded.draft = load_draft_model(draft_model, loaded, dtype=dtype).model
        return loaded

    return load
