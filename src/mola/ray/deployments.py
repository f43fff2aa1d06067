"""The Ray Serve application: an ingress that speaks mola's HTTP API, and
replicas that each hold one resident base with its adapter slots.

The ingress reads a request's body once for its ``model`` and forwards the
raw request to a replica through a handle with
``.options(multiplexed_model_id=model)``: Ray's router prefers a replica
that reports the id loaded, then the one holding the fewest ids. The
replica answers through mola's own app (create_app: every dialect, errors,
SSE) and streams the answer back piece by piece (asgi.py). Its engine
batches every request it holds, of any adapter (no ``@serve.batch``, which
would split batches by model id).

Adapters are Ray's multiplexed models. The replica's multiplexed loader
asks mola's registry for the adapter (a lease taken and given back), so a
load, and the LRU eviction that makes room for it, are the registry's: an
adapter is evicted only once no request runs on it, and requests running on
it finish on it. Ray's own LRU list (one id per slot, the same requests
touching both) mirrors the registry's slots, and is what Ray routes by.

A replica that dies mid-request: the ingress answers that request with
mola's error shapes (failures.py) and Ray starts a new replica; requests on
the other replicas never notice.
"""

from __future__ import annotations

import json
import os

from ray import serve
from ray.exceptions import RayError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .asgi import Head, RawRequest, call
from .failures import StreamTail, before_answer, replica_lost

REPLICA_HEADER = b"x-mola-replica"  # which replica (its process id) answered


def model_of(body: bytes) -> str:
    """The body's ``model``, or "" (no routing preference; the replica's app answers the bad body)."""
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return ""
    return model if isinstance(model, str) else ""


class Warm:
    """Ray's record of an adapter held by a replica. Ray's LRU dropping it
    frees nothing itself: the registry evicts the slot when it needs one."""

    def __init__(self, model_id: str, found: bool):
        self.model_id, self.found = model_id, found


def replica_class(max_models: int):
    """The replica deployment's class, Ray keeping up to ``max_models`` ids per replica (the slots)."""

    class MolaReplica:
        async def __init__(self, config):
            from ..bases.control import Bases
            from ..server.app import create_app
            from ..server.metrics import Metrics
            from ..server.startup import start_base

            self.bases = Bases.declared(config, Metrics(), start_base)
            await self.bases.preload()
            self.app = create_app(self.bases.default.state, self.bases)
            self.pid = str(os.getpid()).encode()

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def adapter(self, model_id: str) -> Warm:
            from ..errors import MolaError

            registry = self.bases.default.state.registry
            if model_id == registry.base_id:
                return Warm(model_id, True)
            try:
                (await registry.acquire(model_id)).release()  # loads it into a slot, if it is not in one
            except MolaError:  # unknown, or cannot load: the app answers the request with the error
                return Warm(model_id, False)
            return Warm(model_id, True)

        async def answer(self, req: RawRequest):
            model = serve.get_multiplexed_model_id()
            if model:
                await self.adapter(model)
            async for piece in call(self.app, req):
                if isinstance(piece, Head):
                    piece = Head(piece.status, piece.headers + ((REPLICA_HEADER, self.pid),))
                yield piece

        def check_health(self):
            state = self.bases.default.state
            if state is not None and not state.engine.is_alive:
                raise RuntimeError("the engine thread is down")  # Ray replaces this replica

    return MolaReplica


@serve.deployment
class MolaIngress:
    def __init__(self, replica):
        self.replica = replica  # a DeploymentHandle of the replicas

    async def __call__(self, request: Request):
        body = await request.body()
        req = RawRequest(request.method, request.url.path, request.url.query.encode(),
                         tuple(request.headers.raw), body)
        model = model_of(body)
        handle = self.replica.options(stream=True, multiplexed_model_id=model) if model \
            else self.replica.options(stream=True)
        pieces = handle.answer.remote(req)
        try:
            head = await pieces.__anext__()
        except (RayError, StopAsyncIteration) as e:
            status, headers, content = before_answer(req.path, replica_lost(type(e).__name__))
            return Response(content, status, headers)
        # (Ray's proxy sets X-Request-Id itself, from the one mola echoed)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers if k.lower() != b"x-request-id"}
        return StreamingResponse(self.rest(pieces, req.path), head.status, headers)

    @staticmethod
    async def rest(pieces, path: str):
        tail = StreamTail(path)
        try:
            async for chunk in pieces:
                tail.see(chunk)
                yield chunk
        except RayError as e:  # the replica died part-way: end the answer as the dialect ends a failure
            yield tail.end(replica_lost(type(e).__name__))
