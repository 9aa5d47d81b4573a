"""kvhint's vLLM endpoint plugin: the router's KV hint, from a request body to
``engine_client.generate(kv_hints=...)``.

vLLM 0.34.0 takes a KV-hint envelope (``vllm/v1/kv_hints/protocol.py``) only
through ``EngineClient.generate(..., kv_hints=...)``; its OpenAI server accepts a
``kv_hints`` key in a body and ignores it. This plugin (entry point ``kvhint`` in
the group ``vllm.endpoint_plugins``, loaded when ``VLLM_PLUGINS`` names it)
replaces ``POST /v1/completions`` and ``POST /v1/chat/completions`` with a thin
route that

1. reads the JSON body and takes ``kv_hints`` out of it;
2. decodes it strictly into vLLM's own ``KvHintsEnvelope`` (``msgspec.convert``;
   a malformed envelope is a 400 in vLLM's error shape, never dropped quietly);
3. validates the rest with the request model of vLLM's own route and calls that
   route's handler, with the envelope set in a context variable that the
   engine client's ``generate`` (wrapped once, in ``init_state``) passes on as
   ``kv_hints=``.

So everything but the hint is vLLM's own code path: rendering, sampling,
streaming, errors. A request without ``kv_hints`` behaves exactly as without
the plugin. Every prompt of a batched completion gets the same envelope.
"""

import contextvars
import inspect
from typing import Any

__all__ = ["KvHintEndpointPlugin", "ROUTES"]

#: The routes the plugin takes over (POST only; other methods stay vLLM's).
ROUTES = ("/v1/completions", "/v1/chat/completions")

_KV_HINTS: contextvars.ContextVar[Any] = contextvars.ContextVar("kvhint_kv_hints", default=None)


def _error(status: int, message: str, kind: str = "BadRequestError"):
    from fastapi.responses import JSONResponse

    # vLLM's ErrorResponse shape (vllm/entrypoints/serve/engine/protocol.py).
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": status}},
    )


def decode_kv_hints(value: Any):
    """The envelope as vLLM's own type, strictly; raises ValueError when malformed."""
    import msgspec
    from vllm.v1.kv_hints.protocol import KvHintsEnvelope

    try:
        return msgspec.convert(value, KvHintsEnvelope)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"malformed kv_hints envelope: {e}") from e


def _post_route(app: Any, path: str):
    from fastapi.routing import APIRoute

    for route in app.routes:
        if isinstance(route, APIRoute) and route.path == path and "POST" in route.methods:
            return route
    return None


def _request_model(endpoint: Any):
    """The pydantic model vLLM's handler takes as its first argument."""
    params = list(inspect.signature(endpoint, eval_str=True).parameters.values())
    return params[0].annotation


def _handler(original: Any):
    from fastapi import Request
    from pydantic import ValidationError

    endpoint = original.endpoint
    model = _request_model(endpoint)

    async def kvhint_route(raw_request: Request):
        try:
            body = await raw_request.json()
        except ValueError as e:
            return _error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the body is a JSON object")
        envelope = None
        if "kv_hints" in body:
            hints = body.pop("kv_hints")
            if hints is not None:
                try:
                    envelope = decode_kv_hints(hints)
                except ValueError as e:
                    return _error(400, str(e))
        try:
            request = model.model_validate(body)
        except ValidationError as e:
            return _error(400, str(e))
        token = _KV_HINTS.set(envelope)
        try:
            # vLLM's own handler (with its cancellation and load tracking); the
            # body is read already, as its with_cancellation expects.
            return await endpoint(request, raw_request)
        finally:
            _KV_HINTS.reset(token)

    kvhint_route.__name__ = f"kvhint_{getattr(endpoint, '__name__', 'route')}"
    return kvhint_route


def _wrap_generate(engine_client: Any) -> None:
    """Makes ``engine_client.generate`` pass the current request's envelope on."""
    if getattr(engine_client, "_kvhint_wrapped", False):
        return
    generate = engine_client.generate

    def kvhint_generate(*args: Any, **kwargs: Any):
        envelope = _KV_HINTS.get()
        if envelope is not None and kwargs.get("kv_hints") is None:
            kwargs["kv_hints"] = envelope
        return generate(*args, **kwargs)

    engine_client.generate = kvhint_generate
    engine_client._kvhint_wrapped = True


class KvHintEndpointPlugin:
    """``vllm.plugins.endpoint_plugins.interface.EndpointPlugin`` for kvhint."""

    name = "kvhint"
    # Completions and chat exist only on a server that generates.
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.routes: list[str] = []

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter

        router = APIRouter()
        for path in ROUTES:
            original = _post_route(app, path)
            if original is None:
                continue  # this server does not serve it
            router.add_api_route(path, _handler(original), methods=["POST"])
            self.routes.append(path)
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is None:
            return  # the render-only server has no engine (and no generate task)
        _wrap_generate(engine_client)
