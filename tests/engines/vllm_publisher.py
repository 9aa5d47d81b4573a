#!/usr/bin/env python3
"""Run vLLM 0.23.0's own ZmqEventPublisher for live tests.

Needs only msgspec and pyzmq (tests/engines/requirements.txt) and the vLLM
0.23.0 wheel; vLLM itself is not installed or imported. The wheel's
``vllm/distributed/kv_events.py`` (publisher and the array-encoded
``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
structs) is read straight out of the zip and executed with stand-ins for the
three engine-internal modules it imports, by ``make_golden.load_engine`` (the
same loader the golden fixtures are made with; nothing is extracted to disk).

    python3 tests/engines/vllm_publisher.py --endpoint tcp://*:PORT \
        [--replay-endpoint tcp://*:PORT] [--topic T] [--bind | --connect] \
        [--buffer-steps N] [--dp-rank R] [--wheel PATH]

Wheel: ``--wheel PATH``, else ``$KVHINT_VLLM_WHEEL``, else the first
``vllm-0.23.0-*.whl`` in ``~/.cache/kvhint/engine-wheels``, else
``python3 -m pip download --no-deps vllm==0.23.0 -d ~/.cache/kvhint/engine-wheels``
(~274 MB) is run first.

Bind or connect: vLLM 0.23's publisher has no ``bind`` argument. It decides
from the (dp-offset) PUB endpoint alone: bind if it contains ``*`` or ``::``
or starts with ``ipc://`` / ``inproc://``, connect otherwise. Unlike SGLang,
``tcp://0.0.0.0:P`` and ``tcp://127.0.0.1:P`` *connect*; to have the
publisher bind on TCP use ``tcp://*:P``. (``tcp://[::1]:P`` contains ``::``
and so is bound, but the socket has no IPV6 option set, so that bind fails.)
The replay ROUTER socket is always bound. ``--bind`` / ``--connect`` are only
assertions here: if vLLM's rule would do the other thing for the endpoint
given, the driver refuses to start (``{"error": ...}``, exit 1). The decision
is reported as ``"bind"`` in the ready line.

DP rank: ``--dp-rank R`` is passed as ``data_parallel_rank`` as vLLM's
scheduler does (``parallel_config.data_parallel_index``). With R > 0 vLLM
offsets both endpoints: tcp endpoints get port + R (the text after the last
``:``), inproc endpoints get ``_dp{R}`` appended, anything else (ipc://) is
refused with ValueError. Batches are built with ``data_parallel_rank=None``
as the scheduler builds them; ``publish()`` fills in R, so every payload is a
3-element array ``[ts, events, R]``. The endpoints actually used are reported
in the ready line.

Protocol: one JSON object per line on stdin, one per line on stdout.

* on start, and after a restart:
  ``{"ready": true, "endpoint": ..., "replay_endpoint": ..., "bind": bool}``
  (``{"restarted": true, ...}`` after a restart)
* ``{"op": "publish", "events": [...], "drop": false}``: events are dicts with
  vLLM 0.23's field names plus ``"type"`` (BlockStored / BlockRemoved /
  AllBlocksCleared). Hashes are ints (u64 or i64 range); ``{"bytes_hex": "..."}``
  gives a bytes hash. For BlockStored, ``parent_block_hash``, ``lora_id`` and
  ``lora_name`` default to null and ``medium`` to "GPU"; for BlockRemoved
  ``medium`` defaults to "GPU". ``extra_keys``, ``group_idx``,
  ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` take the
  structs' defaults (null). The structs say ``omit_defaults=True``, but
  msgspec does not omit anything from ``array_like`` structs (msgspec issue
  #720), so every field is on the wire, as from the engine.
  Replies ``{"published": seq}`` once the publisher thread has sent the batch
  on the PUB socket and put it in its replay buffer. With ``"drop": true`` the
  batch goes through the publisher normally (gets a seq, is kept for replay)
  but its PUB send is suppressed; the reply is ``{"published": seq, "dropped": true}``.
* ``{"op": "restart"}``: shut the publisher down and start a new one on the
  same endpoints (seq restarts at 0, empty replay buffer).
* ``{"op": "quit"}``: shut down, print ``{"bye": true}``, exit 0.

Any error prints ``{"error": "..."}`` and the loop goes on.

Replay, as vLLM 0.23 serves it (``_service_replay``): the ROUTER accepts a
request only if it arrives as exactly 3 frames ``[identity, b"", start]``, so
a DEALER must send ``[b"", start]`` (a REQ socket adds the empty frame itself,
but would then only accept the first reply). ``start`` is read with
``int.from_bytes(start, "big")``, any length. Each buffered batch with
seq >= start comes back as ``[b"", seq(8 bytes BE), payload]`` (no topic
frame), then an end marker ``[b"", b"\\xff" * 8, b""]``; other requests get
no reply at all (a warning is logged). The publisher thread polls the replay
socket only between queue reads that block for up to 100 ms, so an idle
publisher answers a replay request within ~0-100 ms.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import zmq

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402  (engine-wheel module loader)

VERSION = "0.23.0"
SEND_TIMEOUT = 10.0
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kvhint", "engine-wheels")


def find_wheel(explicit: str | None) -> str:
    path = explicit or os.environ.get("KVHINT_VLLM_WHEEL")
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"vLLM wheel {path} does not exist")
        return path
    pat = os.path.join(CACHE_DIR, f"vllm-{VERSION}-*.whl")
    hits = sorted(glob.glob(pat))
    if not hits:
        os.makedirs(CACHE_DIR, exist_ok=True)
        print(f"downloading vllm=={VERSION} into {CACHE_DIR}", file=sys.stderr)
        # stdout is the protocol channel: keep pip's chatter on stderr.
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "--no-deps", f"vllm=={VERSION}",
             "-d", CACHE_DIR],
            stdout=sys.stderr,
        )
        hits = sorted(glob.glob(pat))
        if not hits:
            raise FileNotFoundError(f"pip download left no {pat}")
    return hits[0]


def vllm_binds(endpoint: str | None) -> bool:
    """vLLM 0.23 ZmqEventPublisher._socket_setup's bind/connect heuristic
    (checked against the wheel's source in load())."""
    return endpoint is not None and (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


# The heuristic as the wheel writes it; if this is not in the source,
# vllm_binds() no longer describes the publisher.
_HEURISTIC_SRC = """\
            if self._endpoint is not None and (
                "*" in self._endpoint
                or "::" in self._endpoint
                or self._endpoint.startswith("ipc://")
                or self._endpoint.startswith("inproc://")
            ):
                self._pub.bind(self._endpoint)
            elif self._endpoint is not None:
                self._pub.connect(self._endpoint)
"""


def load(wheel: str) -> Any:
    src = make_golden.read_from_wheel(wheel, make_golden.KV_EVENTS_PATH["vllm"])
    if _HEURISTIC_SRC not in src:
        raise RuntimeError(f"{wheel}: ZmqEventPublisher's bind/connect rule changed")
    return make_golden.load_engine(f"vllm-{VERSION}", wheel).mod


kv: Any = None  # the wheel's vllm.distributed.kv_events, set in main()


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


def _hash(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"bytes_hex"}:
        return bytes.fromhex(v["bytes_hex"])
    return v


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pub: Any = None
        self.tap: PubTap | None = None

    def start(self) -> dict:
        a = self.args
        endpoint = kv.ZmqEventPublisher.offset_endpoint_port(a.endpoint, a.dp_rank)
        binds = vllm_binds(endpoint)
        if a.bind is not None and a.bind != binds:
            raise ValueError(
                f"vLLM 0.23 would {'bind' if binds else 'connect'} {endpoint!r} "
                f"(it binds only endpoints containing '*' or '::', ipc:// and inproc://; "
                f"it has no bind option), but --{'bind' if a.bind else 'connect'} was given"
            )
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self.pub = kv.ZmqEventPublisher(
                    data_parallel_rank=a.dp_rank,
                    endpoint=a.endpoint,
                    replay_endpoint=a.replay_endpoint,
                    buffer_steps=a.buffer_steps,
                    topic=a.topic,
                )
                break
            except zmq.ZMQError as e:
                # A just-closed socket may hold the port for a moment. (A failed
                # constructor leaves its sockets to the garbage collector.)
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.tap = PubTap(self.pub._pub)
        self.pub._pub = self.tap  # the thread looks self._pub up on every send
        return {"endpoint": self.pub._endpoint, "replay_endpoint": self.pub._replay_endpoint,
                "bind": binds}

    def stop(self) -> None:
        if self.pub is None:
            return
        pub, self.pub = self.pub, None
        pub.shutdown()

    def build_event(self, d: dict) -> Any:
        d = dict(d)
        typ = d.pop("type", None)
        if typ not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            raise ValueError(f"unknown event type {typ!r}")
        if "block_hashes" in d:
            d["block_hashes"] = [_hash(h) for h in d["block_hashes"]]
        if typ == "BlockStored":
            d["parent_block_hash"] = _hash(d.get("parent_block_hash"))
            d.setdefault("lora_id", None)
            d.setdefault("medium", kv.MEDIUM_GPU)
            d.setdefault("lora_name", None)
            if isinstance(d.get("extra_keys"), list):  # list[tuple | None]
                d["extra_keys"] = [tuple(k) if isinstance(k, list) else k
                                   for k in d["extra_keys"]]
        elif typ == "BlockRemoved":
            d.setdefault("medium", kv.MEDIUM_GPU)
        return getattr(kv, typ)(**d)

    def publish(self, msg: dict) -> dict:
        if self.pub is None or self.tap is None:
            raise RuntimeError("publisher is not running")
        events = [self.build_event(e) for e in msg.get("events", [])]
        batch = kv.KVEventBatch(ts=time.time(), events=events)  # rank filled by publish()
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
    global kv
    ap = argparse.ArgumentParser(description="vLLM 0.23.0 ZmqEventPublisher for live tests")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint", default=None)
    ap.add_argument("--topic", default="")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--bind", dest="bind", action="store_const", const=True,
                   help="assert that vLLM's rule binds the endpoint")
    g.add_argument("--connect", dest="bind", action="store_const", const=False,
                   help="assert that vLLM's rule connects the endpoint")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--wheel", default=None,
                    help="vllm 0.23.0 wheel (default: $KVHINT_VLLM_WHEEL, then "
                         "~/.cache/kvhint/engine-wheels, downloading it there if missing)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    runner = Runner(args)
    try:
        kv = load(find_wheel(args.wheel))
        out({"ready": True, **runner.start()})
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
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
