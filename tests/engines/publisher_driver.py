"""The engine-independent half of the live-test publisher drivers
(``sglang_publisher.py``, ``vllm_publisher.py``).

Each driver runs one engine's own ``ZmqEventPublisher`` and is driven over
stdin/stdout with one JSON object per line (the protocol is described in the
drivers' docstrings and relied on by tests/engine_live.rs). This module holds
what the two share: the command-line options common to both, the command
loop (publish / restart / quit), the tap on the publisher's PUB socket that
can swallow one send and lets the caller wait until a batch has actually been
sent and put in the replay buffer, and the output helper.

A driver subclasses :class:`Runner` with what is engine-specific (building
that engine's batch from the JSON events, constructing its publisher, its
bind/connect rule, its shutdown) and calls :func:`serve`.

Drivers set ``sys.dont_write_bytecode = True`` before importing this module,
so no ``__pycache__`` is written into the source tree.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import traceback
from typing import Any, Callable

import zmq

SEND_TIMEOUT = 10.0
BIND_RETRY = 5.0  # how long to retry a port a just-closed socket still holds


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

    def set_drop_next(self, drop: bool) -> None:
        with self._cond:
            self.drop_next = drop

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


EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def split_event(d: dict) -> tuple[str, dict]:
    """A JSON event's ``"type"`` (checked) and a copy of its other fields."""
    d = dict(d)
    typ = d.pop("type", None)
    if typ not in EVENT_TYPES:
        raise ValueError(f"unknown event type {typ!r}")
    return typ, d


class Runner:
    """One engine publisher at a time, on the endpoints from the command line.

    Subclasses provide:

    * ``make_publisher()``: construct the engine's ``ZmqEventPublisher`` from
      ``self.args`` (may raise ``zmq.ZMQError``; EADDRINUSE is retried);
    * ``build_batch(events)``: the engine's ``KVEventBatch`` for a list of
      JSON event dicts;
    * optionally ``check_start()`` (runs before each start; returns extra
      fields for the ready line) and ``shutdown(pub)``.

    Both engines' publishers keep the PUB socket in ``_pub`` (looked up on
    every send, so it can be swapped for a :class:`PubTap`), the endpoints
    actually used in ``_endpoint`` / ``_replay_endpoint``, and the replay
    buffer in ``_buffer`` as ``(seq, payload)`` pairs.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pub: Any = None
        self.tap: PubTap | None = None

    # engine-specific hooks

    def check_start(self) -> dict:
        return {}

    def make_publisher(self) -> Any:
        raise NotImplementedError

    def build_batch(self, events: list[dict]) -> Any:
        raise NotImplementedError

    def shutdown(self, pub: Any) -> None:
        pub.shutdown()

    # shared machinery

    def start(self) -> dict:
        extra = self.check_start()
        deadline = time.monotonic() + BIND_RETRY
        while True:
            try:
                self.pub = self.make_publisher()
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
                **extra}

    def stop(self) -> None:
        if self.pub is None:
            return
        pub, self.pub = self.pub, None
        self.shutdown(pub)

    def publish(self, msg: dict) -> dict:
        if self.pub is None or self.tap is None:
            raise RuntimeError("publisher is not running")
        batch = self.build_batch(msg.get("events", []))
        drop = bool(msg.get("drop", False))
        before = self.tap.last_seq
        self.tap.set_drop_next(drop)
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


def arg_parser(description: str, bind_help: str | None = None,
               connect_help: str | None = None) -> argparse.ArgumentParser:
    """The options both drivers take; a driver may add its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint", default=None)
    ap.add_argument("--topic", default="")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--bind", dest="bind", action="store_const", const=True, help=bind_help)
    g.add_argument("--connect", dest="bind", action="store_const", const=False,
                   help=connect_help)
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--dp-rank", type=int, default=0)
    return ap


def serve(runner: Runner, load: Callable[[], None] | None = None) -> int:
    """Load the engine module (``load``), start the publisher, print the ready
    line, then answer commands from stdin until ``quit`` or end of input.
    Returns the exit status."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        if load is not None:
            load()
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
