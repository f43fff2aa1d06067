"""GET /v1/models and /v1/models/{id}: every declared base, loaded or not,
with its status (parent null), and every adapter it serves, resident or not
(parent = its base's id, root = its path), as vLLM reports them; then the image
base and its adapters, if one is served (``"kind": "image"``). An adapter that
changes the token embedding or the output head, once read, says how in
``"vocab"`` (mola's field: LoRA ranks there, token rows replaced). POST
/v1/models/{id}/load and /unload load a base now (one that failed is tried
again at once) and unload an idle one (admin routes)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...blas import blas_in_use
from ...errors import BaseBusy, ModelNotFound
from .. import completion_bodies as p
from ...bases.record import Base

router = APIRouter()


def _base_cards(base: Base, created: int) -> list[dict]:
    """The base's card (with its status), then its adapters'."""
    state = base.state
    if state is not None:
        card = p.model_card(state.base_id, state.created, state.base_root, None, state.max_model_len)
        adapters = [(r.name, r.created, r.path, r.kind, r.vocab) for r in state.registry.adapters()]
        max_len = state.max_model_len
    else:  # not loaded: what its settings declare
        card, max_len = p.model_card(base.name, created, base.config.model, None, None), None
        adapters = [(n, created, path, None, None) for n, path in base.adapter_paths().items()]
    card["status"] = base.status.value
    if base.error is not None and base.status.value == "failed":
        card["error"] = base.error
    if base.config.engine.kv_bits is not None:
        card["kv_cache"] = _quantized_kv(base.config.engine)
    # what a request to it may carry, once loaded: ["text"], or ["text", "image"] (a vision base and its adapters)
    inputs = {} if state is None else {"input_modalities": ["text", "image"] if state.takes_images else ["text"]}
    card.update(inputs)
    # an adapter's "kind": "lora", "alora" or "dora" once read (null before); "vocab": its embedding/head parts
    return [card, *({**p.model_card(n, c, path, card["id"], max_len), "kind": kind, **inputs,
                     **({"vocab": v} if v else {})} for n, c, path, kind, v in adapters)]


def _quantized_kv(engine) -> dict:
    """--kv-bits, and whether a row's answer is then bit-identical alone and in
    any batch (docs/operations.md): the cache is, but it rounds the keys and
    values it is given, so it is only where the products before it do not
    depend on the batch's shape: MLX's reference BLAS, not OpenBLAS (whose
    kernels go by shape) nor, as far as mola has shown, a GPU or Accelerate."""
    return {"bits": engine.kv_bits, "group_size": engine.kv_group_size,
            "batch_invariant": blas_in_use() == "reference"}


def _image_cards(request: Request, created: int) -> list[dict]:
    """The image base (POST /v1/images/generations, docs/images.md) and its named
    adapters, marked ``"kind": "image"`` (mola's field); none without one."""
    images = getattr(request.app.state, "images", None)
    if images is None:
        return []
    card = {**p.model_card(images.name, created, images.worker.path, None, None), "kind": "image",
            "status": "loaded" if images.worker.is_alive else "failed"}
    return [card, *({**p.model_card(name, created, use.path, images.name, None), "kind": "image"}
                    for name, use in images.adapters.items())]


def _cards(request: Request) -> list[dict]:
    bases = request.app.state.bases
    default = bases.default.state  # None while the default base is unloaded
    created = default.created if default is not None else 0
    return [card for base in bases for card in _base_cards(base, created)] + _image_cards(request, created)


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": _cards(request)}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    for card in _cards(request):
        if card["id"] == model_id:
            return card
    raise ModelNotFound(model_id, param=None)


def _base_named(request: Request, model_id: str):
    base = request.app.state.bases.by_name.get(model_id)
    if base is None:
        raise ModelNotFound(model_id, param=None)
    return base


@router.post("/v1/models/{model_id:path}/load")
async def load_model(model_id: str, request: Request):
    """Load the base now; its card once loaded (a failed load: 503 with why)."""
    bases = request.app.state.bases
    base = await bases.load(_base_named(request, model_id).name)
    return _base_cards(base, bases.default.state.created if bases.default.state else 0)[0]


@router.post("/v1/models/{model_id:path}/unload")
async def unload_model(model_id: str, request: Request):
    """Unload the base now if it is loaded and idle (409 if requests are in flight on it)."""
    bases = request.app.state.bases
    base = _base_named(request, model_id)
    if base.status.value == "loaded" and not await bases.unload(base.name):
        raise BaseBusy(f"The model '{base.name}' has requests in flight (or is pinned); it stays loaded.")
    return _base_cards(base, bases.default.state.created if bases.default.state else 0)[0]
