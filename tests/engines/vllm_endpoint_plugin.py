#!/usr/bin/env python3
"""kvhint's vLLM endpoint plugin (python/kvhint-vllm) under vLLM 0.34.0's own
plugin loader and interface, with the engine client stubbed.

Usage: vllm_endpoint_plugin.py --wheel VLLM.whl --plugin python/kvhint-vllm
                               [--body FORWARDED.json] [--chat-body FORWARDED.json]

What is vLLM's own code here, read out of the wheel (never installed; its
dependency tree is the GPU engine's):
- ``vllm/plugins/__init__.py``: ``load_endpoint_plugins`` (entry-point discovery
  in ``vllm.endpoint_plugins``, the ``VLLM_PLUGINS`` allowlist, the
  ``required_tasks`` gate), with ``vllm/envs.py`` reading ``VLLM_PLUGINS``;
- ``vllm/plugins/endpoint_plugins/interface.py``: the ``EndpointPlugin``
  protocol, ``attach_endpoint_plugins`` (which replaces core routes with the
  plugin's) and ``init_endpoint_plugins_state``; with ``vllm/logger.py`` and
  ``vllm/logging_utils/formatter.py``;
- ``vllm/v1/kv_hints/protocol.py``: ``KvHintsEnvelope`` (msgspec), which the
  plugin decodes into and the stubbed engine checks it received.

What is stubbed, and why: ``vllm/__init__.py``, ``vllm/v1/__init__.py`` and the
other parent packages are empty shells (the real ones import torch);
``vllm.engine.protocol`` is a stub with an ``EngineClient`` class (the real one
imports vLLM's config, hence torch): interface.py only names it in annotations.
vLLM's own ``/v1/completions`` and ``/v1/chat/completions`` handlers import
torch too, so the core routes the plugin replaces are stand-ins with the same
signature (``(request: Model, raw_request: Request)``) that call
``engine_client.generate(prompt, sampling_params, request_id, **kw)`` as vLLM's
serving classes do; the engine client is a stub that records its arguments.

The plugin is found the way pip would install it: a ``kvhint_vllm-*.dist-info``
with the ``entry_points.txt`` written from ``pyproject.toml``'s
``[project.entry-points]`` table, on ``sys.path`` beside ``src/``.

Prints one JSON line: ``{"ok": true, "kv_hints": <what the engine got>, ...}``
or ``{"ok": false, "error": ...}`` (exit 1).
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import tomllib
import traceback
import types
import zipfile

sys.dont_write_bytecode = True

NEEDED = (
    "vllm/plugins/__init__.py",
    "vllm/plugins/endpoint_plugins/__init__.py",
    "vllm/plugins/endpoint_plugins/interface.py",
    "vllm/envs.py",
    "vllm/logger.py",
    "vllm/logging_utils/formatter.py",
    "vllm/v1/kv_hints/__init__.py",
    "vllm/v1/kv_hints/protocol.py",
)


def shell(name, path=None):
    mod = types.ModuleType(name)
    mod.__path__ = [path] if path else []
    sys.modules[name] = mod
    return mod


def load_vllm(wheel, into):
    with zipfile.ZipFile(wheel) as z:
        for name in NEEDED:
            z.extract(name, into)
    root = os.path.join(into, "vllm")
    shell("vllm", root)
    shell("vllm.v1", os.path.join(root, "v1"))
    shell("vllm.logging_utils", os.path.join(root, "logging_utils"))
    # vllm/logger.py imports these two names from the package.
    import vllm.logging_utils.formatter as formatter

    sys.modules["vllm.logging_utils"].ColoredFormatter = formatter.ColoredFormatter
    sys.modules["vllm.logging_utils"].NewLineFormatter = formatter.NewLineFormatter
    shell("vllm.engine")
    protocol = types.ModuleType("vllm.engine.protocol")

    class EngineClient:  # the real ABC imports vllm.config (torch)
        pass

    protocol.EngineClient = EngineClient
    sys.modules["vllm.engine.protocol"] = protocol


def make_dist_info(plugin_dir, into):
    with open(os.path.join(plugin_dir, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    dist = os.path.join(into, f"kvhint_vllm-{project['version']}.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        for group, entries in project["entry-points"].items():
            f.write(f"[{group}]\n")
            for name, target in entries.items():
                f.write(f"{name} = {target}\n")
    sys.path.insert(0, into)
    sys.path.insert(0, os.path.join(plugin_dir, "src"))


class StubEngine:
    """Records every generate call; yields one finished output."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt, sampling_params, request_id, **kwargs):
        self.calls.append(
            {"prompt": prompt, "sampling_params": sampling_params, "request_id": request_id, **kwargs}
        )

        async def outputs():
            yield {"request_id": request_id, "text": "ok", "finished": True}

        return outputs()


def core_app():
    """A FastAPI app with stand-ins for vLLM's core OpenAI routes."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict

    class CompletionRequest(BaseModel):  # vLLM's allows extra keys too
        model_config = ConfigDict(extra="allow")
        model: str | None = None
        prompt: list[int] | str
        max_tokens: int = 16

    class ChatCompletionRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: str | None = None
        messages: list[dict]

    app = FastAPI()

    async def run(prompt, request, raw_request):
        engine = raw_request.app.state.engine_client
        request_id = raw_request.headers.get("x-request-id", "r")
        texts = []
        async for out in engine.generate(prompt, {"max_tokens": 16}, request_id, priority=0):
            texts.append(out["text"])
        return JSONResponse({"object": "text_completion", "choices": [{"text": "".join(texts)}]})

    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await run({"prompt_token_ids": request.prompt}, request, raw_request)

    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await run({"prompt_token_ids": [1, 2, 3]}, request, raw_request)

    app.post("/v1/completions")(create_completion)
    app.post("/v1/chat/completions")(create_chat_completion)
    return app


async def call(app, path, body, headers=()):
    """One HTTP request straight into the ASGI app; returns (status, JSON)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "app": app,
    }
    sent = [{"type": "http.request", "body": raw, "more_body": False}]
    out = {"status": None, "body": b""}
    finished = asyncio.Event()

    async def receive():
        if sent:
            return sent.pop(0)
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")
            if not message.get("more_body"):
                finished.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    return out["status"], json.loads(out["body"] or b"null")


def check(cond, what):
    if not cond:
        raise AssertionError(what)


async def run(args):
    import msgspec

    os.environ["VLLM_PLUGINS"] = "kvhint"
    work = tempfile.mkdtemp(prefix="kvhint-vllm-plugin-")
    load_vllm(args.wheel, os.path.join(work, "wheel"))
    make_dist_info(os.path.abspath(args.plugin), os.path.join(work, "site"))

    import vllm.plugins as plugins
    from vllm.plugins.endpoint_plugins.interface import (
        EndpointPlugin,
        attach_endpoint_plugins,
        init_endpoint_plugins_state,
    )
    from vllm.v1.kv_hints.protocol import KvHintsEnvelope

    # vLLM's gate: a server that does not generate does not load it.
    check(plugins.load_endpoint_plugins(("embed",)) == [], "loaded for an embed-only server")
    os.environ.pop("VLLM_PLUGINS")
    check(plugins.load_endpoint_plugins(("generate",)) == [], "loaded without VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = "kvhint"

    app = core_app()
    attach_endpoint_plugins(app, ("generate",))
    loaded = app.state.endpoint_plugins
    check([p.name for p in loaded] == ["kvhint"], f"loaded {loaded}")
    check(isinstance(loaded[0], EndpointPlugin), "not an EndpointPlugin")
    for path in ("/v1/completions", "/v1/chat/completions"):
        posts = [r for r in app.routes if getattr(r, "path", None) == path and "POST" in r.methods]
        check(len(posts) == 1, f"{path}: {len(posts)} POST routes")
        check(posts[0].endpoint.__name__.startswith("kvhint_"), f"{path} is not the plugin's")

    engine = StubEngine()
    app.state.engine_client = engine
    await init_endpoint_plugins_state(engine, app.state, argparse.Namespace())

    report = {"ok": True}
    bodies = []
    if args.body:
        with open(args.body) as f:
            bodies.append(("/v1/completions", json.load(f)))
    if args.chat_body:
        with open(args.chat_body) as f:
            bodies.append(("/v1/chat/completions", json.load(f)))
    envelope = {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
         "payload": {"source_control_endpoint": "tcp://10.0.0.2:23280", "block_hashes": [1, 2]}}]}
    if not args.body:
        bodies.append(("/v1/completions", {"prompt": [1, 2], "kv_hints": envelope}))
    if not args.chat_body:
        chat = {"messages": [{"role": "user", "content": "hi"}], "kv_hints": envelope}
        bodies.append(("/v1/chat/completions", chat))
    for path, body in bodies:
        check("kv_hints" in body, f"{path}: the forwarded body has no kv_hints")
        engine.calls.clear()
        status, reply = await call(app, path, body, [(b"x-request-id", b"kvh-test")])
        check(status == 200, f"{path}: {status} {reply}")
        check(len(engine.calls) == 1, f"{path}: {len(engine.calls)} generate calls")
        got = engine.calls[0]["kv_hints"]
        check(type(got) is KvHintsEnvelope, f"{path}: generate got {type(got)}")
        check(got == msgspec.convert(body["kv_hints"], KvHintsEnvelope), f"{path}: {got}")
        check(engine.calls[0]["priority"] == 0, "vLLM's own keywords pass through")
        if path == "/v1/completions":
            check(
                engine.calls[0]["prompt"] == {"prompt_token_ids": body["prompt"]},
                f"the prompt reached generate: {engine.calls[0]['prompt']}",
            )
            report["kv_hints"] = msgspec.to_builtins(got)
        else:
            report["chat_kv_hints"] = msgspec.to_builtins(got)

        # The same body without kv_hints: generate gets none.
        plain = {k: v for k, v in body.items() if k != "kv_hints"}
        engine.calls.clear()
        status, reply = await call(app, path, plain)
        check(status == 200, f"{path} without kv_hints: {status} {reply}")
        check(engine.calls[0].get("kv_hints") is None, "a hint leaked into the next request")

        # A malformed envelope is refused before the engine sees the request.
        bad = dict(body, kv_hints={"protocol_version": 1, "message_id": "m", "actions": []})
        engine.calls.clear()
        status, reply = await call(app, path, bad)
        check(status == 400, f"{path} malformed: {status} {reply}")
        check("kv_hints" in reply["error"]["message"], f"{reply}")
        check(engine.calls == [], "the engine saw a malformed envelope")
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--wheel", required=True)
    parser.add_argument("--plugin", required=True)
    parser.add_argument("--body")
    parser.add_argument("--chat-body")
    args = parser.parse_args()
    try:
        report = asyncio.run(run(args))
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                          "trace": traceback.format_exc()}), flush=True)
        return 1
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
