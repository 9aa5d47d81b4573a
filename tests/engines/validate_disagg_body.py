#!/usr/bin/env python3
"""Check a body the gateway sent to one leg of a disaggregated prefill/decode
pair with the engine's own released code.

Usage: validate_disagg_body.py [--wheel VLLM.whl] ENGINE ROUTE LEG BODY.json
  ENGINE sglang|vllm, ROUTE generate|chat|completions, LEG prefill|decode; the
  vLLM wheel: --wheel or $KVHINT_VLLM_PLUGIN_WHEEL (as vllm_endpoint_plugin.py).
Prints one JSON line, ``{"ok": true, ...}`` with the fields as the engine decoded
them, or ``{"ok": false, "error": "..."}`` (exit 1).

SGLang 0.5.23, installed; sglang/__init__.py is never run, files are loaded by
path under empty package shells (as validate_sglang_body.py):
- generate: ``api/v1/api_types.py`` ``GenerateRequest.from_json_value``; prints
  bootstrap_host/port/room, routed_dp_rank, disagg_prefill_dp_rank, rid, input_ids.
- chat/completions: ``srt/entrypoints/openai/protocol.py``, pydantic
  ``ChatCompletionRequest``/``CompletionRequest`` (both ``PDRoutingFields``);
  prints ``pd_routing_kwargs()``, rid, model. protocol.py imports ``openai``
  (SGLang pins openai==2.8.0, pure Python, not in requirements.txt); without it
  only ``PDRoutingFields`` (+ ``_migrate_deprecated_dp_rank``) runs, exec'd from
  protocol.py via ast, and ``sglang_model`` says which. ``sglang.utils`` (numpy,
  requests, IPython) is a shell with its own ``convert_json_schema_to_str`` (ast).
- then, both legs: bootstrap_host a non-empty string, bootstrap_port an int,
  bootstrap_room an int in [0, 2^63) (pydantic's lax mode takes "5").

vLLM 0.34.0, read out of the wheel (never installed, no torch): the NIXL
connector's scheduler side in pull mode (NixlConnector's). Run as modules:
``nixl/metadata.py``, ``nixl/base_scheduler.py``, ``nixl/pull_scheduler.py``, with
``envs.py``, ``logger.py``, ``logging_utils/formatter.py``, ``utils/math_utils.py``.
Exec'd via ast (their files import torch): ``kv_connector/utils.py`` EngineId,
BlockIds, clip_ssm_state_blocks, yield_req_data; ``kv_connector/v1/base.py`` the
two metadata base classes; ``v1/request.py`` RequestStatus. Stand-ins (named only
in annotations, isinstance over empty lists, or the handshake thread):
VllmConfig, current_platform ("cuda"), make_zmq_path, zmq_ctx, SchedulerOutput,
kv_cache_interface specs. The scheduler's own ``__init__`` runs on a stand-in
config: TP/DCP/PP 1, block 16, empty kv_connector_extra_config (vLLM's defaults),
one full-attention KV group, no spec decode. A request is a namespace (chat's
prompt: 32 placeholder ids).
- prefill: ``on_new_request``; ``get_num_new_matched_tokens`` must be (0, False);
  ``update_state_after_alloc`` must batch it to send; ``request_finished`` after a
  length-capped finish must hold the blocks and answer do_remote_prefill (printed
  as ``would_return``). Then vLLM's proxy examples' body: kv_transfer_params ==
  {do_remote_decode: true, do_remote_prefill: false, remote_engine_id,
  remote_block_ids, remote_host, remote_port: null}, max_tokens 1
  (max_completion_tokens 1 if present), stream absent/false, no stream_options.
- decode (kv_transfer_params as the prefill's ``request_finished`` answered):
  ``get_num_new_matched_tokens`` must load remotely, ``update_state_after_alloc``
  queue the pull (its "Got invalid KVTransferParams" check), ``on_new_request``
  start the lease heartbeat, ``build_connector_meta`` (``NixlConnectorMetadata.
  add_new_req_to_recv``) make the ``RemoteMeta``: printed. Then types:
  remote_block_ids per-group int lists, remote_host/engine_id str, remote_port int.
Not run: vLLM's pydantic Completion/ChatCompletionRequest (import vllm.config,
sampling_params, renderers: torch); only prompt/messages present and
kv_transfer_params an object are checked. vLLM ROUTE generate is refused: the
gateway sends /generate to SGLang only.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import types
import zipfile

sys.dont_write_bytecode = True
PROXY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def module(name, path=None, **attrs):
    """An empty package shell (``path``: where its real submodules are) or a stand-in."""
    mod = types.ModuleType(name)
    if path is not None:
        mod.__path__ = [path] if path else []
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load_file(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def from_source(src, filename, modname, names, **extra):
    """Exec only the named top-level definitions of an engine file (with its
    stdlib imports) as module ``modname``: the engine's code, minus the rest."""
    keep = []
    for node in ast.parse(src).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            wanted = all(m.split(".")[0] in sys.stdlib_module_names for m in mods)
        else:
            wanted = getattr(node, "name", None) in names or any(
                getattr(t, "id", None) in names for t in getattr(node, "targets", ()))
        if wanted:
            keep.append(node)
    mod = module(modname, **extra)
    exec(compile(ast.Module(body=keep, type_ignores=[]), filename, "exec"), mod.__dict__)
    check(all(n in mod.__dict__ for n in names), f"{filename}: not all of {names} found")
    return mod


# ---------------------------------------------------------------- SGLang
def sglang_generate(root, body):
    for name in ("sglang", "sglang.api", "sglang.api.v1"):
        module(name, "")
    api_types = load_file("sglang.api.v1.api_types", os.path.join(root, "api", "v1", "api_types.py"))
    r = api_types.GenerateRequest.from_json_value(body)
    return {k: getattr(r, k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room",
                                       "routed_dp_rank", "disagg_prefill_dp_rank", "rid", "input_ids")}


def sglang_openai(root, route, body):
    from pydantic import BaseModel

    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai"):
        module(name, "")
    path = os.path.join(root, "srt", "entrypoints", "openai", "protocol.py")
    with open(os.path.join(root, "utils.py")) as f:
        from_source(f.read(), os.path.join(root, "utils.py"), "sglang.utils",
                    ["convert_json_schema_to_str"], BaseModel=BaseModel)
    if importlib.util.find_spec("openai") is not None:
        protocol = load_file("sglang.srt.entrypoints.openai.protocol", path)
        model = protocol.ChatCompletionRequest if route == "chat" else protocol.CompletionRequest
    else:
        with open(path) as f:
            protocol = from_source(f.read(), path, "sglang_pd_routing",
                                   ["PDRoutingFields", "_migrate_deprecated_dp_rank"], BaseModel=BaseModel)
        model = protocol.PDRoutingFields
        check(("messages" if route == "chat" else "prompt") in body, f"{route}: no prompt/messages")
    r = model.model_validate(body)
    return {"sglang_model": model.__name__, **r.pd_routing_kwargs(),
            **{k: getattr(r, k) for k in ("rid", "model") if hasattr(r, k)}}


def run_sglang(route, leg, body):
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    root = list(spec.submodule_search_locations)[0]
    fields = sglang_generate(root, body) if route == "generate" else sglang_openai(root, route, body)
    # Then the contract (SGLang's own decoding has the first word).
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    check(isinstance(host, str) and host, f"bootstrap_host must be a non-empty string: {host!r}")
    check(isinstance(port, int) and not isinstance(port, bool), f"bootstrap_port must be an int: {port!r}")
    check(isinstance(room, int) and not isinstance(room, bool) and 0 <= room < 2**63,
          f"bootstrap_room must be an int in [0, 2^63): {room!r}")
    return {"engine": "sglang", "route": route, "leg": leg, **fields}


# ---------------------------------------------------------------- vLLM
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
FILES = ("vllm/envs.py", "vllm/logger.py", "vllm/logging_utils/formatter.py", "vllm/utils/math_utils.py",
         f"{NIXL}/metadata.py", f"{NIXL}/base_scheduler.py", f"{NIXL}/pull_scheduler.py")


def load_vllm(wheel, into):
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # vLLM's handler would print on stdout
    with zipfile.ZipFile(wheel) as z:
        for name in FILES:
            z.extract(name, into)
        read = {n: z.read(n).decode() for n in (
            "vllm/distributed/kv_transfer/kv_connector/utils.py",
            "vllm/distributed/kv_transfer/kv_connector/v1/base.py", "vllm/v1/request.py")}
    root = os.path.join(into, "vllm")
    for pkg in ("", "logging_utils", "utils", "distributed", "distributed/kv_transfer",
                "distributed/kv_transfer/kv_connector", "distributed/kv_transfer/kv_connector/v1",
                "distributed/kv_transfer/kv_connector/v1/nixl", "v1", "v1/core", "v1/core/sched"):
        module(".".join(["vllm", *pkg.split("/")]).rstrip("."), os.path.join(root, pkg))
    formatter = importlib.import_module("vllm.logging_utils.formatter")
    sys.modules["vllm.logging_utils"].ColoredFormatter = formatter.ColoredFormatter
    sys.modules["vllm.logging_utils"].NewLineFormatter = formatter.NewLineFormatter

    def placeholder(name):
        return type(name, (), {"__doc__": "stand-in: only named in annotations or isinstance"})

    def never(*_a, **_k):
        raise RuntimeError("a stand-in was called")

    module("vllm.config", VllmConfig=placeholder("VllmConfig"))
    module("vllm.platforms", current_platform=types.SimpleNamespace(device_type="cuda"))
    module("vllm.utils.network_utils", make_zmq_path=never)
    module(f"{NIXL.replace('/', '.')}.utils", zmq_ctx=never)
    module("vllm.v1.core.sched.output", SchedulerOutput=placeholder("SchedulerOutput"))
    module("vllm.v1.kv_cache_interface", **{n: placeholder(n) for n in (
        "FullAttentionSpec", "MambaSpec", "SlidingWindowSpec")})
    for rel, names, extra in (
        ("vllm/distributed/kv_transfer/kv_connector/utils.py",
         ["EngineId", "BlockIds", "clip_ssm_state_blocks", "yield_req_data"], {}),
        ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",
         ["KVConnectorHandshakeMetadata", "KVConnectorMetadata"], {}),
        ("vllm/v1/request.py", ["RequestStatus"], {"FinishReason": placeholder("FinishReason")}),
    ):
        from_source(read[rel], f"{wheel}!{rel}", rel[:-3].replace("/", "."), names, **extra)
    pkg = NIXL.replace("/", ".")
    return (importlib.import_module(f"{pkg}.metadata"),
            importlib.import_module(f"{pkg}.pull_scheduler").NixlPullConnectorScheduler)


def make_scheduler(cls):
    ns = types.SimpleNamespace
    config = ns(
        parallel_config=ns(tensor_parallel_size=1, decode_context_parallel_size=1,
                           data_parallel_index=0, pipeline_parallel_size=1),
        cache_config=ns(block_size=16),
        kv_transfer_config=ns(get_from_extra_config=lambda key, default: default, kv_buffer_device="cuda"),
        scheduler_config=ns(disable_hybrid_kv_cache_manager=False),
        num_prefill_lookahead_tokens=0)
    kv_cache = ns(transfer_groups=[], kv_cache_groups=[], has_mamba_layers=False,
                  hash_block_size=16, select_transfer_block_ids=lambda ids: ids)
    return cls(config, "kvhint-check-engine", kv_cache)


def request(params, prompt_ids, rid):
    return types.SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(prompt_ids),
                                 num_prompt_tokens=len(prompt_ids), num_computed_tokens=0, status=None,
                                 skip_reading_external_kv=False, prompt_embeds=None)


def blocks(block_ids):
    block = types.SimpleNamespace(block_hash=None, is_null=False)
    return types.SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: (list(block_ids),),
                                 blocks=[[block for _ in block_ids]])


def run_vllm(wheel, route, leg, body):
    check(route != "generate", "vllm: the gateway sends vLLM no /generate (SGLang's route only)")
    check(isinstance(wheel, str) and os.path.isfile(wheel),
          "no vLLM wheel: pass --wheel or set KVHINT_VLLM_PLUGIN_WHEEL")
    check(("messages" if route == "chat" else "prompt") in body, f"{route}: no messages/prompt")
    params = body.get("kv_transfer_params")
    check(isinstance(params, dict), f"kv_transfer_params must be an object: {params!r}")
    with tempfile.TemporaryDirectory(prefix="kvhint-disagg-") as tmp:
        metadata, scheduler_cls = load_vllm(wheel, tmp)
        logs = logging.Handler(logging.WARNING)
        logs.lines = []
        logs.emit = lambda record: logs.lines.append(record.getMessage())
        vlog = logging.getLogger("vllm")
        vlog.addHandler(logs)
        vlog.propagate = False
        sched = make_scheduler(scheduler_cls)
        prompt = body["prompt"] if route == "completions" and isinstance(body["prompt"], list) \
            and all(isinstance(t, int) for t in body["prompt"]) else list(range(1, 33))
        rid = "kvhint-check-req"
        req = request(json.loads(json.dumps(params)), prompt, rid)
        out = {"engine": "vllm", "route": route, "leg": leg, "kv_transfer_params": params}
        sched.on_new_request(req)
        matched = sched.get_num_new_matched_tokens(req, 0)
        if leg == "prefill":  # vLLM's P side first, then the proxy examples' body
            check(tuple(matched) == (0, False), f"P side would load remote KV: {matched}")
            sched.update_state_after_alloc(req, blocks([1, 2]), 0)
            check(rid in sched._reqs_in_batch, "P side would not batch it to send its KV "
                  f"(update_state_after_alloc wants do_remote_decode) {logs.lines}")
            req.status = sys.modules["vllm.v1.request"].RequestStatus.FINISHED_LENGTH_CAPPED
            req.num_computed_tokens = len(prompt)
            delay, answer = sched.request_finished(req, ([1, 2],))
            check(delay and answer and answer["do_remote_prefill"] is True,
                  f"P side would free the blocks at once: {delay} {answer}")
            check(params == PROXY_PREFILL, f"prefill kv_transfer_params must be {PROXY_PREFILL}: {params}")
            check(body.get("max_tokens") == 1, f"prefill max_tokens must be 1: {body.get('max_tokens')!r}")
            check(body.get("max_completion_tokens", 1) == 1, "prefill max_completion_tokens must be 1")
            check(body.get("stream", False) is False, f"prefill stream must be false: {body.get('stream')!r}")
            check("stream_options" not in body, "prefill must carry no stream_options")
            out.update(max_tokens=1, stream=False, would_return=answer,
                       scheduler={"matched_tokens": matched, "in_batch": True, "delay_free_blocks": delay})
        else:  # vLLM's D side first: would it load, queue the pull, renew the lease?
            check(matched[1] is True and matched[0] > 0, f"D side would not load the KV remotely: {matched}")
            sched.update_state_after_alloc(req, blocks([100, 101]), matched[0])
            check(rid in sched._reqs_need_recv, f"D side would not pull the KV: {logs.lines}")
            heartbeat = sched._heartbeat_by_engine.get(params["remote_engine_id"])
            check(heartbeat is not None, "D side would not renew the prefill's KV lease (on_new_request "
                  "needs remote_engine_id, remote_request_id, remote_host, remote_port, tp_size)")
            meta = sched.build_connector_meta(None)
            check(isinstance(meta, metadata.NixlConnectorMetadata) and rid in meta.reqs_to_recv, "no recv meta")
            rm = meta.reqs_to_recv[rid]
            check(isinstance(rm.remote, metadata.RemoteMeta), "no RemoteMeta")
            check(params.get("do_remote_decode") is False, f"decode do_remote_decode must be false: {params}")
            ids = params["remote_block_ids"]
            check(isinstance(ids, list) and all(isinstance(g, list) and all(
                isinstance(b, int) and not isinstance(b, bool) for b in g) for g in ids),
                f"remote_block_ids must be BlockIds (a list of per-group int lists): {ids!r}")
            check(isinstance(params["remote_port"], int) and isinstance(params["remote_host"], str)
                  and isinstance(params["remote_engine_id"], str), "remote_host/remote_engine_id must be "
                  "strings and remote_port an int")
            out.update(scheduler={"matched_tokens": matched, "need_recv": True,
                                  "heartbeat": dataclasses.asdict(heartbeat)},
                       remote=dataclasses.asdict(rm.remote),
                       req_meta={k: getattr(rm, k) for k in ("tp_size", "dcp_size", "pp_size", "remote_block_size")})
        check(not logs.lines, f"vLLM warned: {logs.lines}")
        return json.loads(json.dumps(out, default=sorted))


def main(argv):
    try:
        args = list(argv)
        wheel = os.environ.get("KVHINT_VLLM_PLUGIN_WHEEL")
        if "--wheel" in args:
            wheel = args.pop(args.index("--wheel") + 1)
            args.remove("--wheel")
        check(len(args) == 4, "usage: validate_disagg_body.py [--wheel VLLM.whl] ENGINE ROUTE LEG BODY.json")
        engine, route, leg, path = args
        check(engine in ("sglang", "vllm"), f"ENGINE must be sglang or vllm: {engine}")
        check(route in ("generate", "chat", "completions"), f"ROUTE must be generate, chat or completions: {route}")
        check(leg in ("prefill", "decode"), f"LEG must be prefill or decode: {leg}")
        with open(path, "rb") as f:
            body = json.load(f)
        check(isinstance(body, dict), "the body is not a JSON object")
        out = run_sglang(route, leg, body) if engine == "sglang" else run_vllm(wheel, route, leg, body)
        print(json.dumps({"ok": True, **out}), flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
