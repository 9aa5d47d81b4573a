#!/usr/bin/env python3
"""vLLM 0.23.0's own ZmqEventPublisher, one per simulated worker, in one process.

    python3 tests/engines/sim_publishers.py --wheel W \
        --endpoints tcp://*:P1,tcp://*:P2,... --replay-endpoints tcp://*:R1,...

The simulated engine (``tests/support/sim.rs``, ``kvhint-sim``) keeps each
worker's KV cache and writes what changes to this process's stdin, one JSON
object per line: ``{"worker": i, "events": [...]}``, each event a dict with
vLLM 0.23's field names plus ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), as ``vllm_publisher.py`` takes them. Each batch goes out
through worker i's own publisher (vLLM's code, read out of the wheel by
``make_golden.load_engine``), so a router subscribed to it sees exactly what it
would see from vLLM: the msgpack batches, the sequence numbers, the replay
socket. Prints ``{"ready": true, "workers": N}`` once every publisher is up, and
exits when stdin closes.

Many publishers in one interpreter rather than one process each: a fleet of 64
simulated workers would otherwise start 64 interpreters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_publisher  # noqa: E402  (vLLM's kv_events module and its event builder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True, help="the vllm 0.23.0 wheel")
    ap.add_argument("--endpoints", required=True, help="comma-separated PUB endpoints")
    ap.add_argument("--replay-endpoints", required=True, help="comma-separated ROUTER endpoints")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    args = ap.parse_args()
    endpoints = args.endpoints.split(",")
    replays = args.replay_endpoints.split(",")
    if len(endpoints) != len(replays):
        print(json.dumps({"ready": False, "error": "as many replay endpoints as endpoints"}))
        return 1
    kv = vllm_publisher.load(vllm_publisher.find_wheel(args.wheel))
    vllm_publisher.kv = kv
    publishers = [
        kv.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=endpoint,
            replay_endpoint=replay,
            buffer_steps=args.buffer_steps,
            topic="",
        )
        for endpoint, replay in zip(endpoints, replays)
    ]
    print(json.dumps({"ready": True, "workers": len(publishers)}), flush=True)
    # The event builder only reads the module-level `kv`; it needs no runner state.
    build_event = vllm_publisher.VllmRunner.build_event
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
            events = [build_event(None, e) for e in message["events"]]
            batch = kv.KVEventBatch(ts=time.time(), events=events)
            publishers[message["worker"]].publish(batch)
        except Exception as e:  # a bad line is reported, the rest go on
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), file=sys.stderr, flush=True)
    for publisher in publishers:
        publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
