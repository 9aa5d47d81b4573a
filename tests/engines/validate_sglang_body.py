#!/usr/bin/env python3
"""Check a body the gateway forwarded to SGLang's ``POST /generate`` with SGLang
0.5.23's own code, as its HTTP entrypoint does:

1. the contract gate ``sglang/api/v1/api_types.py``:
   ``GenerateRequest.from_json_value(body)`` (generated from SGLang's .proto; it
   raises ``JsonContractError``, an HTTP 400 in the server, on a wrong type);
2. the strict envelope decoding ``sglang/srt/managers/kv_hints.py``:
   ``msgspec.convert(body["kv_hints"], KvHintsEnvelope)`` (through the module's
   own ``decode_kv_hints_envelope``, which is what rejects a malformed envelope).

Usage: validate_sglang_body.py BODY.json
Prints one JSON line: ``{"ok": true, "kv_hints": <the decoded envelope>,
"input_ids": [...], "rid": ..., "routed_dp_rank": ...}``, each value as SGLang
decoded it; on any failure prints ``{"ok": false, "error": "..."}`` and exits 1.

Like ``sglang_publisher.py``, it does not run ``sglang/__init__.py`` (which pulls
in torch and the HF patches): it finds the installed package without executing
it and loads the three files it needs by path (``api_types.py``,
``srt/utils/msgspec_utils.py`` which ``kv_hints.py`` imports, and
``srt/managers/kv_hints.py``) under empty stand-ins for their parent packages.
Nothing of SGLang is re-implemented or stubbed beyond those package shells.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

sys.dont_write_bytecode = True


def _load(root: str, modname: str, rel: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(modname, os.path.join(root, rel))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


def load_sglang() -> tuple[types.ModuleType, types.ModuleType]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    root = list(spec.submodule_search_locations)[0]
    for name in (
        "sglang",
        "sglang.api",
        "sglang.api.v1",
        "sglang.srt",
        "sglang.srt.utils",
        "sglang.srt.managers",
    ):
        shell = types.ModuleType(name)
        shell.__path__ = []
        sys.modules.setdefault(name, shell)
    api_types = _load(root, "sglang.api.v1.api_types", os.path.join("api", "v1", "api_types.py"))
    _load(root, "sglang.srt.utils.msgspec_utils", os.path.join("srt", "utils", "msgspec_utils.py"))
    kv_hints = _load(
        root, "sglang.srt.managers.kv_hints", os.path.join("srt", "managers", "kv_hints.py")
    )
    return api_types, kv_hints


def main() -> int:
    import msgspec

    try:
        with open(sys.argv[1], "rb") as f:
            body = json.load(f)
        api_types, kv_hints = load_sglang()
        request = api_types.GenerateRequest.from_json_value(body)
        if "kv_hints" not in body:
            raise ValueError("the body has no kv_hints")
        # Strict: the type kv_hints.py declares, exactly as decode_kv_hints_envelope does.
        envelope = msgspec.convert(body["kv_hints"], kv_hints.KvHintsEnvelope)
        assert envelope == kv_hints.decode_kv_hints_envelope(body["kv_hints"])
        print(
            json.dumps(
                {
                    "ok": True,
                    "kv_hints": msgspec.to_builtins(envelope),
                    "input_ids": request.input_ids,
                    "rid": request.rid,
                    "routed_dp_rank": request.routed_dp_rank,
                    "gate_kv_hints": msgspec.to_builtins(request.kv_hints),
                }
            ),
            flush=True,
        )
        return 0
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
