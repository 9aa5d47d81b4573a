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
(~274 MB) is run first. The tests always pass ``--wheel``: the harness downloads
the wheel once into ``target/e2e/engine-wheels`` (``tests/support/provision.rs``);
the fallbacks are for running this script by hand.

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

Any error prints ``{"error": "..."}`` and the loop goes on. The command
loop, the send tap and the protocol replies are in ``publisher_driver.py``
(shared with ``sglang_publisher.py``); this file holds what is vLLM's.

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

import glob
import os
import subprocess
import sys
import time
from typing import Any

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402  (engine-wheel module loader)
import publisher_driver  # noqa: E402  (command loop and send tap shared with sglang_publisher.py)

VERSION = "0.23.0"
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


def _hash(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"bytes_hex"}:
        return bytes.fromhex(v["bytes_hex"])
    return v


class VllmRunner(publisher_driver.Runner):
    def check_start(self) -> dict:
        a = self.args
        endpoint = kv.ZmqEventPublisher.offset_endpoint_port(a.endpoint, a.dp_rank)
        binds = vllm_binds(endpoint)
        if a.bind is not None and a.bind != binds:
            raise ValueError(
                f"vLLM 0.23 would {'bind' if binds else 'connect'} {endpoint!r} "
                f"(it binds only endpoints containing '*' or '::', ipc:// and inproc://; "
                f"it has no bind option), but --{'bind' if a.bind else 'connect'} was given"
            )
        return {"bind": binds}

    def make_publisher(self) -> Any:
        a = self.args
        return kv.ZmqEventPublisher(
            data_parallel_rank=a.dp_rank,
            endpoint=a.endpoint,
            replay_endpoint=a.replay_endpoint,
            buffer_steps=a.buffer_steps,
            topic=a.topic,
        )

    def build_event(self, d: dict) -> Any:
        typ, d = publisher_driver.split_event(d)
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

    def build_batch(self, events: list[dict]) -> Any:
        events = [self.build_event(e) for e in events]
        return kv.KVEventBatch(ts=time.time(), events=events)  # rank filled by publish()


def main() -> int:
    ap = publisher_driver.arg_parser(
        "vLLM 0.23.0 ZmqEventPublisher for live tests",
        bind_help="assert that vLLM's rule binds the endpoint",
        connect_help="assert that vLLM's rule connects the endpoint",
    )
    ap.add_argument("--wheel", default=None,
                    help="vllm 0.23.0 wheel (default: $KVHINT_VLLM_WHEEL, then "
                         "~/.cache/kvhint/engine-wheels, downloading it there if missing)")
    args = ap.parse_args()

    def load_kv() -> None:
        global kv
        kv = load(find_wheel(args.wheel))

    return publisher_driver.serve(VllmRunner(args), load_kv)


if __name__ == "__main__":
    sys.exit(main())
