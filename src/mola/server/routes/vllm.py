"""vLLM's adapter endpoints, so that tooling written for vLLM works unchanged:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}
    POST /v1/unload_lora_adapter  {"lora_name"}

Success is a 200 with vLLM's plain-text message; errors use vLLM's status
codes (404 for a path or name that does not exist, 400 for an invalid adapter,
a name that breaks the adapter id grammar or one already loaded; 403 for a
path outside the allowed adapter directories) in OpenAI's error envelope.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ...errors import AdapterExists, AdapterNotFound
from ...registry.names import check_adapter_id
from .. import protocol as p
from ..errors import error_response
from ..base_leases import state_for
from ...frontend.state import ServerState

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: p.VLLMLoadLoRARequest, request: Request):
    state: ServerState = await state_for(request, None)  # the default base
    check_adapter_id(body.lora_name, param="lora_name")
    try:
        await state.registry.load(body.lora_name, body.lora_path)
    except AdapterExists:
        return error_response(
            400, f"The lora adapter '{body.lora_name}' has already been loaded.",
            "invalid_request_error", "lora_name", "adapter_exists",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: p.VLLMUnloadLoRARequest, request: Request):
    state: ServerState = await state_for(request, body.lora_name)
    try:
        await state.registry.unload(body.lora_name)
    except AdapterNotFound:
        return error_response(
            404, f"The lora adapter '{body.lora_name}' cannot be found.",
            "invalid_request_error", "lora_name", "adapter_not_found",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
