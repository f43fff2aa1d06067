"""Client helpers for a running mola: push an adapter from a training loop.

    from mola.client import push_adapter
    for step in range(steps):
        ...                                          # train an mlx-lm model with LoRALinear layers
        if step % 50 == 0:
            push_adapter("http://127.0.0.1:8000", "policy", model, admin_key=KEY)

``push_adapter`` sends the model's LoRA factors (its LoRALinear layers'
``lora_a`` / ``lora_b``, named as mlx-lm names its trainable parameters) and
their scale to PUT /v1/adapters/{name}/weights as one safetensors body: the
server serves them as a new version of ``name`` at once, from memory, while
requests already running finish on the version they started with.
"""

from __future__ import annotations

import json
import struct


def write_safetensors(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``tensors`` (float32, float16 or bfloat16),
    written with numpy: what ``mx.save_safetensors`` writes to a stream,
    without its per-write Python callbacks (a training loop's push builds its
    body with it)."""
    import mlx.core as mx
    import numpy as np

    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    chunks, offset = [], 0
    for key in sorted(tensors):
        x = tensors[key]
        if x.dtype == mx.bfloat16:
            host, dtype = np.asarray(x.view(mx.uint16)), "BF16"
        else:
            host = np.asarray(x)
            dtype = names.get(host.dtype)
            if dtype is None:
                raise ValueError(f"'{key}' is of type {x.dtype}; float32, float16 or bfloat16 only")
        data = np.ascontiguousarray(host).tobytes()
        header[key] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return b"".join([struct.pack("<Q", len(text)), text, *chunks])


def adapter_body(model, alora_invocation_tokens: list[int] | None = None) -> bytes:
    """The safetensors body of ``model``'s LoRA factors (mlx-lm LoRALinear layers,
    or DoRALinear ones with their magnitudes; one scale), with its
    adapter_config in the metadata (mola.adapters.pushed);
    ``alora_invocation_tokens``: an activated LoRA's invocation."""
    from mlx.utils import tree_flatten

    # mlx-lm's DoRALinear layers also hold a magnitude "m" beside their factors (pushed as DoRA)
    dora = {f"{p}.m" for p, m in model.named_modules() if hasattr(m, "lora_a") and "m" in m}
    factors = {k: v for k, v in tree_flatten(model.parameters()) if k.endswith((".lora_a", ".lora_b")) or k in dora}
    scales = {float(m.scale) for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "scale")}
    if not factors or len(scales) != 1:
        raise ValueError(f"expected LoRA layers of one scale, found {len(factors)} factors and scales {scales}")
    ranks = {v.shape[-1] for k, v in factors.items() if k.endswith(".lora_a")}
    config = {"fine_tune_type": "dora" if dora else "lora",
              "lora_parameters": {"rank": max(ranks), "scale": scales.pop()}}
    if alora_invocation_tokens is not None:
        config["alora_invocation_tokens"] = [int(t) for t in alora_invocation_tokens]
    return write_safetensors(factors, {"adapter_config": json.dumps(config)})


def push_adapter(url: str, name: str, model, *, scale: float = 1.0, base: str | None = None,
                 admin_key: str | None = None, persist: bool = False,
                 alora_invocation_tokens: list[int] | None = None, timeout: float = 120.0,
                 client=None) -> dict:
    """PUT ``model``'s LoRA factors as adapter ``name`` (``scale`` multiplies them
    on top of their own; ``base``: the base model, default the server's;
    ``persist``: the server also writes them under its first --adapter-dir;
    ``alora_invocation_tokens``: an activated LoRA's invocation); the server's
    adapter object (its ``version``), or httpx.HTTPStatusError with the
    server's error. ``client``: an httpx.Client to send it with, kept by the
    caller across pushes (its connection is reused); without one, a client
    is made for this push, with no TLS context for a plain http:// URL
    (loading the certificates took 52 ms on a loaded machine, more than the
    push itself)."""
    import httpx

    params = {"scale": scale, **({"base": base} if base else {}), **({"persist": "true"} if persist else {})}
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    body = adapter_body(model, alora_invocation_tokens)
    request = dict(content=body, params=params, timeout=timeout,
                   headers={"content-type": "application/octet-stream", **headers})
    target = f"{url.rstrip('/')}/v1/adapters/{name}/weights"
    if client is not None:
        r = client.put(target, **request)
    else:
        with httpx.Client(verify=not target.startswith("http://")) as own:
            r = own.put(target, **request)
    r.raise_for_status()
    return r.json()
