#!/usr/bin/env python3
"""Run SGLang 0.5.23's own ZmqEventPublisher for live tests.

Needs an installed sglang (``pip install --no-deps sglang==0.5.23``) plus
tests/engines/requirements.txt (msgspec, pyzmq, psutil, pydantic). The tests
run it with the harness's own environment (``target/e2e/venv``, which
``tests/support/provision.rs`` makes with both).

Importing ``sglang.srt.disaggregation.kv_events`` the normal way runs
``sglang/__init__.py``, which pulls in the HF-transformers patches,
``sglang.srt.utils.common`` and so numpy/torch. So this script does not import
the package: it finds the installed package directory without executing it
(``importlib.util.find_spec("sglang")`` on a top-level name does not run its
``__init__``) and loads two of its files by path:

* ``sglang/srt/utils/network.py`` (for ``NetworkAddress``; needs psutil, pyzmq),
* ``sglang/srt/disaggregation/kv_events.py`` (the publisher and the structs),

with empty stand-ins for the parent packages and a stub
``sglang.srt.runtime_context`` (only ``is_kv_publisher_rank`` uses it).

    python3 tests/engines/sglang_publisher.py --endpoint tcp://127.0.0.1:PORT \
        [--replay-endpoint tcp://127.0.0.1:PORT] [--topic T] [--bind | --connect] \
        [--buffer-steps N] [--dp-rank R]

``--bind``/``--connect`` map to the publisher's ``bind`` argument; with
neither, SGLang's own heuristic decides (bind for ``*``, ``0.0.0.0``, ``::``,
ipc://, inproc://; connect otherwise). ``--dp-rank R`` is passed to the
publisher as ``attn_dp_rank`` exactly as SGLang's scheduler does, so, like the
engine, the publisher offsets both ports by R and stamps R into every batch
(batches are built with ``attn_dp_rank=None`` and ``publish()`` fills it in).
The endpoints actually used are reported in the ``ready`` line.

Protocol: one JSON object per line on stdin, one per line on stdout.

* on start, and after a restart: ``{"ready": true, "endpoint": ..., "replay_endpoint": ...}``
  (``{"restarted": true, ...}`` after a restart)
* ``{"op": "publish", "events": [...], "drop": false}``: events are dicts with
  SGLang's field names plus ``"type"`` (BlockStored / BlockRemoved /
  AllBlocksCleared). ``medium`` may be a StorageMedium value ("GPU",
  "CPU_PINNED", "DISK", "EXTERNAL"); other strings are passed as they are.
  For BlockStored, ``parent_block_hash`` and ``lora_id`` default to null.
  Replies ``{"published": seq}`` once the publisher thread has sent the batch
  on the PUB socket and put it in its replay buffer. With ``"drop": true`` the
  batch goes through the publisher normally (gets a seq, is kept for replay)
  but its PUB send is suppressed; the reply is ``{"published": seq, "dropped": true}``.
* ``{"op": "restart"}``: shut the publisher down and start a new one on the
  same endpoints (seq restarts at 0, empty replay buffer). SGLang's
  ``shutdown()`` can take up to ~2 s (it waits for its queue to drain).
* ``{"op": "quit"}``: shut down, print ``{"bye": true}``, exit 0.

Any error prints ``{"error": "..."}`` and the loop goes on.

The command loop, the send tap and the protocol replies are in
``publisher_driver.py`` (shared with ``vllm_publisher.py``); this file holds
what is SGLang's.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import time
import types
from typing import Any

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import publisher_driver  # noqa: E402  (command loop and send tap shared with vllm_publisher.py)


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []
    return mod


class _Parallel:
    pp_rank = 0
    attn_tp_rank = 0
    attn_cp_rank = 0


def load_sglang_kv_events() -> types.ModuleType:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    root = list(spec.submodule_search_locations)[0]
    for name, attrs in (
        ("sglang", {}),
        ("sglang.srt", {}),
        ("sglang.srt.utils", {}),
        ("sglang.srt.disaggregation", {}),
        ("sglang.srt.runtime_context", {"get_parallel": lambda: _Parallel()}),
    ):
        sys.modules.setdefault(name, _stub(name, **attrs))

    def load(modname: str, rel: str) -> types.ModuleType:
        path = os.path.join(root, rel)
        s = importlib.util.spec_from_file_location(modname, path)
        assert s is not None and s.loader is not None
        mod = importlib.util.module_from_spec(s)
        sys.modules[modname] = mod
        s.loader.exec_module(mod)
        return mod

    net = load("sglang.srt.utils.network", os.path.join("srt", "utils", "network.py"))
    sys.modules["sglang.srt.utils"].network = net
    return load(
        "sglang.srt.disaggregation.kv_events",
        os.path.join("srt", "disaggregation", "kv_events.py"),
    )


kv: Any = None  # sglang.srt.disaggregation.kv_events, set in main()


class SglangRunner(publisher_driver.Runner):
    def make_publisher(self) -> Any:
        a = self.args
        return kv.ZmqEventPublisher(
            attn_dp_rank=a.dp_rank,
            endpoint=a.endpoint,
            replay_endpoint=a.replay_endpoint,
            buffer_steps=a.buffer_steps,
            topic=a.topic,
            bind=a.bind,
        )

    def shutdown(self, pub: Any) -> None:
        pub.shutdown()
        atexit.unregister(pub.shutdown)  # SGLang registers it; don't run it twice at exit

    def build_event(self, d: dict) -> Any:
        typ, d = publisher_driver.split_event(d)
        if "medium" in d and isinstance(d["medium"], str):
            try:
                d["medium"] = kv.StorageMedium(d["medium"])
            except ValueError:
                pass  # send an unusual medium string as it is
        if typ == "BlockStored":
            d.setdefault("parent_block_hash", None)
            d.setdefault("lora_id", None)
            if "token_ids" in d:  # EAGLE bigram pages are tuples
                d["token_ids"] = [tuple(t) if isinstance(t, list) else t
                                  for t in d["token_ids"]]
        return getattr(kv, typ)(**d)

    def build_batch(self, events: list[dict]) -> Any:
        events = [self.build_event(e) for e in events]
        return kv.KVEventBatch(ts=time.time(), events=events)  # attn_dp_rank filled by publish()


def main() -> int:
    ap = publisher_driver.arg_parser("SGLang 0.5.23 ZmqEventPublisher for live tests")
    args = ap.parse_args()

    def load() -> None:
        global kv
        kv = load_sglang_kv_events()

    return publisher_driver.serve(SglangRunner(args), load)


if __name__ == "__main__":
    sys.exit(main())
