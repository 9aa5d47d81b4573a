#!/usr/bin/env python3
"""Run SGLang 0.5.23's own ZmqEventPublisher for live tests.

Needs an installed sglang (``pip install --no-deps sglang==0.5.23``) plus
tests/engines/requirements.txt (msgspec, pyzmq, psutil, pydantic).

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
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import logging
import os
import sys
import threading
import time
import traceback
import types
from typing import Any

import zmq

SEND_TIMEOUT = 10.0


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


kv = load_sglang_kv_events()


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class PubTap:
    """Stands in for the publisher's PUB socket: records each send (so the
    caller can wait for it) and can swallow the next one (a message lost on
    the wire)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._cond = threading.Condition()
        self.last_seq = -1
        self.drop_next = False

    def send_multipart(self, frames, *args, **kwargs):
        seq = int.from_bytes(frames[1], "big")
        with self._cond:
            drop = self.drop_next
            self.drop_next = False
        if not drop:
            self._sock.send_multipart(frames, *args, **kwargs)
        with self._cond:
            self.last_seq = seq
            self._cond.notify_all()

    def wait_sent(self, after: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.last_seq <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("publisher thread did not send the batch")
                self._cond.wait(left)
            return self.last_seq

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pub: Any = None
        self.tap: PubTap | None = None

    def start(self) -> dict:
        a = self.args
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self.pub = kv.ZmqEventPublisher(
                    attn_dp_rank=a.dp_rank,
                    endpoint=a.endpoint,
                    replay_endpoint=a.replay_endpoint,
                    buffer_steps=a.buffer_steps,
                    topic=a.topic,
                    bind=a.bind,
                )
                break
            except zmq.ZMQError as e:
                # A just-closed socket may hold the port for a moment.
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.tap = PubTap(self.pub._pub)
        self.pub._pub = self.tap  # the thread looks self._pub up on every send
        return {"endpoint": self.pub._endpoint, "replay_endpoint": self.pub._replay_endpoint}

    def stop(self) -> None:
        if self.pub is None:
            return
        pub, self.pub = self.pub, None
        pub.shutdown()
        atexit.unregister(pub.shutdown)  # SGLang registers it; don't run it twice at exit

    def build_event(self, d: dict) -> Any:
        d = dict(d)
        typ = d.pop("type", None)
        if typ not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            raise ValueError(f"unknown event type {typ!r}")
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

    def publish(self, msg: dict) -> dict:
        if self.pub is None or self.tap is None:
            raise RuntimeError("publisher is not running")
        events = [self.build_event(e) for e in msg.get("events", [])]
        batch = kv.KVEventBatch(ts=time.time(), events=events)  # attn_dp_rank filled by publish()
        drop = bool(msg.get("drop", False))
        before = self.tap.last_seq
        with self.tap._cond:
            self.tap.drop_next = drop
        self.pub.publish(batch)
        seq = self.tap.wait_sent(before, SEND_TIMEOUT)
        # The thread appends to the replay buffer right after the send.
        deadline = time.monotonic() + SEND_TIMEOUT
        while not (self.pub._buffer and self.pub._buffer[-1][0] >= seq):
            if time.monotonic() > deadline:
                raise TimeoutError("batch did not reach the replay buffer")
            time.sleep(0.0005)
        reply: dict = {"published": seq}
        if drop:
            reply["dropped"] = True
        return reply


def main() -> int:
    ap = argparse.ArgumentParser(description="SGLang 0.5.23 ZmqEventPublisher for live tests")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint", default=None)
    ap.add_argument("--topic", default="")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--bind", dest="bind", action="store_const", const=True)
    g.add_argument("--connect", dest="bind", action="store_const", const=False)
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--dp-rank", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    runner = Runner(args)
    try:
        out({"ready": True, **runner.start()})
    except Exception as e:
        out({"error": f"start failed: {e!r}"})
        return 1

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "publish":
                out(runner.publish(msg))
            elif op == "restart":
                runner.stop()
                out({"restarted": True, **runner.start()})
            elif op == "quit":
                runner.stop()
                out({"bye": True})
                return 0
            else:
                out({"error": f"unknown op {op!r}"})
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            out({"error": f"{type(e).__name__}: {e}"})
    runner.stop()  # stdin closed
    return 0


if __name__ == "__main__":
    sys.exit(main())
