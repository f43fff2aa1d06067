"""llama.cpp GGUF model files -> mlx-lm models, read with gguf-py.

The hyper-parameters come from the file's metadata (``llama.embedding_length``, ...)
as an mlx-lm config dict (metadata.py); tensors get mlx-lm's module names (``blk.3.attn_q.weight``
-> ``model.layers.3.self_attn.q_proj.weight``); the model is mlx-lm's own class for
the architecture, quantized with ``nn.quantize`` where a tensor stays quantized (see
codecs.py), as ``mlx_lm.utils.load_model`` does. For ``llama`` (Llama, Mistral,
SmolLM, Mixtral) llama.cpp stores the rows of q and k in its own rope order
(``LlamaModel.permute``); they are put back in Hugging Face's order, so the model is
the Hugging Face layout and adapters of either layout apply to it.

Mixtures of experts (qwen3moe, qwen2moe, gpt-oss, llama with experts -> mlx-lm's
qwen3_moe, qwen2_moe, gpt_oss, mixtral): the stacked experts ``blk.N.ffn_*_exps``
(numpy [E, out, in]) are the weights of mlx-lm's SwitchLinear ([E, out, in]) as they
are; which module each tensor is depends on the model type (gguf_names.py).

What cannot be mapped exactly is refused with a message naming it: what metadata.py
refuses, tensors that have no place in the mlx-lm model, codecs codecs.py refuses.
"""

from __future__ import annotations

import importlib
import re
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ModelLoadError
from ..adapters.formats.gguf_names import ARCHITECTURES, block_tensors, hf_row_order
from .codecs import (F32_SCALES, GROUP_SIZE, KEPT, BFloat16, Quantized, QuantizedPair, UnsupportedTensor, codec_name,
                     read_tensor)
from .gguf_arch import BASE_ARCHITECTURES, BaseArchitecture
from .gguf_file import GGUFFile, open_gguf
from .metadata import model_config
from .mx_buffers import as_mx, empty, reused_heap
from .progress import Progress
from .quantized_pair import make_pairs

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
WORKERS = 2  # tensors converted at once (numpy and MLX release the GIL); bounds the numpy forms held


# llama.cpp tensor -> mlx-lm parameter path (".weight"/".bias" appended); the block
# linears' names are gguf_names.py's (dense and mixture-of-experts blocks), the norms
# each architecture's (gguf_arch/)
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"([a-z_]+)\.(weight|bias)")
_CONSUMED = ""  # hf_name's answer for a tensor the architecture reads as metadata (no weight)


def hf_name(name: str, arch: BaseArchitecture | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` in a base
    of architecture ``arch`` (None: llama); None if mola knows no place for it, ""
    for a tensor the architecture reads as metadata (llama 3's rope_freqs)."""
    arch = arch or BASE_ARCHITECTURES["llama"]
    m = _BLOCK_NAME.fullmatch(name)
    if m:
        layer, kind, leaf = int(m.group(1)), m.group(2), m.group(3)
        if f"{kind}.{leaf}" in arch.norms:
            return f"model.layers.{layer}.{arch.norms[f'{kind}.{leaf}']}"
        module = block_tensors(arch.model_type).get(kind) or arch.norms.get(kind)
        return module and f"model.layers.{layer}.{module}.{leaf}"
    m = _GLOBAL_NAME.fullmatch(name)
    if m and m.group(1) in arch.globals:
        module = arch.globals[m.group(1)]
        return _CONSUMED if module is None else f"{module}.{m.group(2)}"
    if m and m.group(1) in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    return None


# ---- tensors ---------------------------------------------------------------------


def _rows(value, fn):
    """Apply ``fn`` to the output rows of a tensor in any of its held forms."""
    if isinstance(value, QuantizedPair):
        return QuantizedPair(_rows(value.low, fn), _rows(value.high, fn))
    if isinstance(value, Quantized):
        return Quantized(fn(value.weight), fn(value.scales), fn(value.biases), value.bits)
    if isinstance(value, BFloat16):
        return BFloat16(fn(value.bits))
    return fn(value)


def _to_mx(value, dtype: mx.Dtype, keep: bool) -> dict[str, mx.array]:
    """{"weight": ...} in ``dtype``, or {"weight", "scales", "biases"} for a quantized
    value with ``keep``; without it quantized values are dequantized (in float32, then
    cast). Kept scales and biases are never rounded: float32 ones (Q4_K, Q5_K, IQ4_XS,
    ...: codecs.py) stay float32 whatever ``dtype``; float16 ones widen exactly to
    float32 where ``dtype`` is float32, else stay float16. A QuantizedPair kept gives
    its high half as {"weight_high", "scales_high", "biases_high"} too
    (models/quantized_pair.py); dequantized, the sum of its halves (exact: one is 0
    wherever the other is not)."""
    if isinstance(value, QuantizedPair):
        low, high = _to_mx(value.low, dtype, keep), _to_mx(value.high, dtype, keep)
        if not keep:
            return {"weight": (low["weight"].astype(mx.float32) + high["weight"].astype(mx.float32)).astype(dtype)}
        return {**low, **{f"{k}_high": v for k, v in high.items()}}
    if isinstance(value, Quantized):
        w, s, b = as_mx(value.weight), as_mx(value.scales), as_mx(value.biases)
        if keep:
            if dtype == mx.float32 and s.dtype != mx.float32:
                s, b = s.astype(mx.float32), b.astype(mx.float32)
            return {"weight": w, "scales": s, "biases": b}
        full = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                             group_size=GROUP_SIZE, bits=value.bits)
        return {"weight": full.astype(dtype)}
    if isinstance(value, BFloat16):
        return {"weight": mx.array(value.bits).view(mx.bfloat16).astype(dtype)}
    return {"weight": as_mx(value).astype(dtype)}


def gguf_config(f: GGUFFile) -> dict:
    """The mlx-lm config of the file's model, from its metadata and tensor names."""
    tensors = {t.name: t for t in f.reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{f.path} has no token_embd.weight.")
    return model_config(f, set(tensors), int(embed.shape[-1]))  # ne [n_embd, n_vocab]


def read_weights(f: GGUFFile, dtype: str, progress: Progress | None = None, config: dict | None = None,
                 ) -> tuple[dict, dict[str, mx.array], dict[str, dict]]:
    """(config, weights by mlx-lm name, {module path: {"bits", "group_size"}} of the
    modules kept quantized). ``dtype``: "keep" or a key of DTYPES. Streamed tensor by
    tensor: each is read, repacked, turned into MLX arrays and evaluated before the
    next, and its pages of the mapped file are given back (GGUFFileReader.release),
    so that what is held at the end (the result) is about all that is ever held;
    ``progress`` advances after each. ``config``: gguf_config's answer, if at hand."""
    keep = dtype == "keep"
    tensors = {t.name: t for t in f.reader.tensors}
    config = gguf_config(f) if config is None else config
    names = {}
    for tensor in tensors.values():
        name = hf_name(tensor.name, f.arch)
        if name is None:
            raise ModelLoadError(
                f"{f.path} holds tensor '{tensor.name}', which has no place in mlx-lm's "
                f"{config['model_type']} model; mola does not drop part of a model silently.")
        names[tensor.name] = name
    codecs = {codec_name(t.tensor_type) for t in tensors.values() if len(t.shape) > 1 and names[t.name]}
    target = keep_dtype(codecs) if keep else DTYPES[dtype]
    heads = ({"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
             if ARCHITECTURES[f.arch.name].permutes_qk else {})
    weights, quantization = {}, {}
    todo = [t for t in tensors.values() if names[t.name] != _CONSUMED]
    # numpy's repacks and MLX's evaluations release the GIL: up to WORKERS tensors are
    # converted at once, and taken in file order as they come
    release = getattr(f.reader, "release", None)  # a converted tensor's file pages (gguf_reader.py)
    with reused_heap(), ThreadPoolExecutor(max_workers=WORKERS) as pool:
        convert = partial(_convert_one, f, config=config, heads=heads, target=target, keep=keep)
        pending = deque(pool.submit(convert, t, names[t.name]) for t in todo[:WORKERS])
        for i, tensor in enumerate(todo):
            arrays, quantized = pending.popleft().result()
            if i + WORKERS < len(todo):
                nxt = todo[i + WORKERS]
                pending.append(pool.submit(convert, nxt, names[nxt.name]))
            weights.update(arrays)
            if release is not None:
                release(int(tensor.data_offset), int(tensor.n_bytes))
            if quantized is not None:
                quantization[names[tensor.name].rpartition(".")[0]] = quantized
            if progress is not None:
                progress.advance(int(tensor.n_bytes), time.monotonic())
    mx.clear_cache()  # MLX's cache of freed buffers (float32 forms cast to float16, say): not held after
    return config, weights, quantization


def _convert_one(f: GGUFFile, tensor, name: str, *, config: dict, heads: dict, target: mx.Dtype, keep: bool):
    """({mlx-lm name: evaluated array}, the module's quantization or None) of one
    tensor; its numpy form is gone when this returns."""
    return _mx_form(name, _read_one(f, tensor, name, config, heads, keep), target, keep)


def _read_one(f: GGUFFile, tensor, name: str, config: dict, heads: dict, keep: bool):
    """One tensor read and put in mlx-lm's layout, in its held form (codecs.py),
    repacked or dequantized into new MLX arrays' memory (mx_buffers.py)."""
    data, proj = None, name.split(".")[-2]
    if proj in heads:  # llama.cpp's q/k rows (weights and biases) back in Hugging Face's order: every
        # form is row for row its raw rows' (a row's blocks), so the raw rows are reordered
        data = hf_row_order(np.asarray(tensor.data), heads[proj])
    try:
        value = read_tensor(tensor, keep, empty, data)
    except UnsupportedTensor as e:
        raise UnsupportedTensor(f"{f.path}: {e.message}") from None
    if name.endswith(".shared_expert_gate.weight") and len(value.shape) == 1:
        value = _rows(value, lambda v: v.reshape(1, -1))  # llama.cpp's {n_embd}: [1, n_embd]
    if f.arch.weights is not None:  # the architecture's per-tensor fixes (gguf_arch/)
        one = {name: value}
        f.arch.weights(one, config)
        value = one[name]
    return value


def _mx_form(name: str, value, target: mx.Dtype, keep: bool) -> tuple[dict[str, mx.array], dict | None]:
    """``value``'s evaluated MLX arrays by full name, and its quantization where it
    stays quantized."""
    module, _, leaf = name.rpartition(".")
    arrays = _to_mx(value, target, keep)
    quantized = None
    if "scales" in arrays:
        quantized = {"group_size": GROUP_SIZE, "bits": value.bits,
                     **({"pair": True} if isinstance(value, QuantizedPair) else {})}
    else:  # a float weight, bias or gpt-oss's sinks
        arrays = {leaf: arrays["weight"]}
    mx.eval(list(arrays.values()))
    return {f"{module}.{k}": v for k, v in arrays.items()}, quantized


def keep_dtype(codecs) -> mx.Dtype:
    """The dtype a model kept as stored computes in, from its matrices' codecs:

    float32 if any is kept with float32 scales (codecs.F32_SCALES: Q4_K, Q5_K, Q6_K,
        IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ1_S), so that they stay exact: their scales
        (Q4_K's d*sc: up to 17 significant bits) are no float16 or bfloat16 numbers, and
        MLX computes a float32-scaled layer in float32 anyway (float16 activations would
        turn float32 at the first one). Everything else widens to float32 exactly:
        float16 scales, F16/BF16 matrices, and the codecs MLX cannot hold exactly
        (Q2_K, IQ2_XS, ..., and Q6_K expert stacks), which keep gguf-py's float32
        values, at 32 bits a weight (a Q4_K_M file: Q4_K at 6 bits a weight, its Q6_K
        matrices at 16 as pairs);
    else float16 if any is F16 or dequantized from a codec MLX cannot hold (as MLX and
        llama.cpp's GPU paths hold them);
    else bfloat16 if any is BF16;
    else float32 (every matrix F32 or kept with float16 scales, which widen exactly)."""
    codecs = set(codecs)
    if codecs & set(F32_SCALES):
        return mx.float32
    if "F16" in codecs or codecs - {"F32", "BF16", *KEPT}:
        return mx.float16
    return mx.bfloat16 if "BF16" in codecs else mx.float32


def build_model(config: dict, weights: dict[str, mx.array], quantization: dict[str, dict]) -> nn.Module:
    """mlx-lm's model for ``config``, quantized where ``quantization`` says, with
    ``weights`` loaded (strictly: every parameter given, nothing left over)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if hasattr(model, "sanitize"):  # as mlx_lm.utils.load_model (phi3, cohere have none)
        weights = model.sanitize(dict(weights))
    pairs = [path for path, q in quantization.items() if q.get("pair")]
    if pairs:  # Q6_K: two quantized halves (models/quantized_pair.py)
        make_pairs(model, pairs, GROUP_SIZE, quantization[pairs[0]]["bits"])
    if len(pairs) < len(quantization):
        nn.quantize(model, class_predicate=lambda path, m: path not in pairs and quantization.get(path, False))
    from mlx.utils import tree_flatten

    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or extra:
        raise ModelLoadError(
            f"the file's tensors do not fit mlx-lm's {config['model_type']} model: "
            + (f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"not in the model {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}" if extra else ""))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # shapes that do not fit the metadata
        raise ModelLoadError(f"the file's tensors do not fit its metadata: {e}") from None
    model.eval()
    mx.eval(model.parameters())
    return model


def load_gguf_model(path: Path, dtype: str, f: GGUFFile | None = None,
                    show_progress: bool = True) -> tuple[nn.Module, dict, GGUFFile]:
    """(mlx-lm model, its config dict, the opened file ``f``, opened here if None)
    for a GGUF model file, converted now (with a progress bar or log lines if it
    takes a while: models/progress.py); models/gguf_load.py reads the conversion
    cache first."""
    f = f or open_gguf(path)
    progress = conversion_progress(f) if show_progress else None
    config, weights, quantization = read_weights(f, dtype, progress)
    if progress is not None:
        progress.close(time.monotonic())
    return assemble(f, config, weights, quantization), config, f


def conversion_progress(f: GGUFFile) -> Progress:
    tensors = f.reader.tensors
    return Progress(Path(f.path).name, len(tensors), sum(int(t.n_bytes) for t in tensors), time.monotonic())


def assemble(f: GGUFFile, config: dict, weights: dict[str, mx.array], quantization: dict[str, dict]) -> nn.Module:
    """The model from read_weights' answer (or the conversion cache's copy of it);
    ``config`` gains its "quantization" (mlx-lm's form) where any layer is kept."""
    try:
        model = build_model(config, weights, quantization)
    except ModelLoadError as e:
        raise ModelLoadError(f"{f.path}: {e.message}") from None
    if f.arch.model is not None:  # the architecture's fixes to mlx-lm's model (gguf_arch/)
        f.arch.model(model, config)
    if quantization:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4, **quantization}
    return model
