#!/usr/bin/env python3
"""Serve a GGUF with llama.cpp's own HTTP server, for tests.

    python3 tests/engines/llamacpp/serve.py --model FILE [--port P] [--parallel N] [--ctx N]
        [--threads N] [--cache-ram MIB] [--kv-unified] [--api-key KEY] [--embeddings]

Runs llama.cpp's C++ server (``llama-server``'s code: ``/health``,
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/apply-template``, ``/metrics``, ``/slots``) in this process through PyPI
``xllamacpp`` (``xllamacpp.Server(CommonParams)``, which starts the HTTP
server on its own threads and returns once the model is loaded), on
127.0.0.1 only. ``--port 0`` (the default) lets the kernel choose a free port.

Prints one line on stdout once ``GET /health`` answers 200:
``{"ready": true, "port": P}``, or ``{"ready": false, "error": "..."}`` and
exits 1 if the server cannot start.

``--cache-ram`` bounds llama.cpp's host-memory prompt cache (``--cache-ram``,
MiB; llama-server's default is 8192, -1 unlimited, 0 off) and ``--kv-unified``
gives the slots one shared KV buffer, as ``llama-server``'s automatic slot count
does: with both, an idle slot's prompt is saved to the cache and cleared when
a new task starts, so what a worker can reuse is what its cache holds. The
routing-quality bench (``tests/benches/quality.rs``) sizes it so that a worker
holds a few prompts, as a real worker holds a bounded number. Exits when stdin closes (the test that
started it is gone) or on SIGTERM/SIGINT. llama.cpp's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
import urllib.error
import urllib.request


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def wait_healthy(port: int, deadline: float) -> None:
    url = f"http://127.0.0.1:{port}/health"
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as e:  # 503 while the model loads
            last = f"HTTP {e.code}"
        except OSError as e:
            last = str(e)
        time.sleep(0.05)
    raise RuntimeError(f"/health on port {port} did not answer 200 in time: {last}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF file to serve")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    ap.add_argument("--parallel", type=int, default=4, help="slots (n_parallel)")
    ap.add_argument("--ctx", type=int, default=4096, help="context size shared by the slots")
    ap.add_argument("--alias", default="tiny-qwen3", help="the model's name in /v1/models")
    ap.add_argument("--threads", type=int, default=1, help="compute threads")
    ap.add_argument(
        "--cache-ram", type=int, default=None, help="prompt cache in MiB (default: llama.cpp's)"
    )
    ap.add_argument("--kv-unified", action="store_true", help="one KV buffer for all slots")
    ap.add_argument("--api-key", help="the key callers must send (llama-server --api-key)")
    ap.add_argument(
        "--embeddings",
        action="store_true",
        help="serve /v1/embeddings (mean pooling) instead of generation",
    )
    args = ap.parse_args()

    try:
        import xllamacpp
    except ImportError as e:
        say({"ready": False, "error": f"cannot import xllamacpp: {e}"})
        return 1

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.model_alias = {args.alias}
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx
    params.n_batch = 512
    params.n_ubatch = 512
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    if args.cache_ram is not None:
        params.cache_ram_mib = args.cache_ram
    params.kv_unified = args.kv_unified
    params.n_threads_http = max(4, args.parallel + 2)
    params.endpoint_slots = True
    params.endpoint_metrics = True
    params.use_jinja = True
    params.warmup = False
    if args.api_key:
        params.api_keys = [args.api_key]
    if args.embeddings:
        params.embedding = True
        params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN

    try:
        server = xllamacpp.Server(params)
    except Exception as e:  # the C++ side raises RuntimeError with its reason logged
        say({"ready": False, "error": f"xllamacpp.Server failed: {e}"})
        return 1
    # llama.cpp installs its own SIGINT/SIGTERM handlers (they stop the loop but
    # leave this process running); put back ones that end it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))

    address = server.listening_address  # "http://127.0.0.1:P"
    try:
        port = int(address.rsplit(":", 1)[1].strip("/"))
        wait_healthy(port, time.monotonic() + 60)
    except Exception as e:
        say({"ready": False, "error": f"{e} (listening_address {address!r})"})
        os._exit(1)
    say({"ready": True, "port": port})

    # Serve until the test closes stdin (or dies: its end of the pipe closes).
    # select with a timeout, not a blocking read: a signal that lands on one of
    # llama.cpp's threads would not interrupt a read here, and Python runs the
    # handler only when this thread gets back to the interpreter.
    stdin = sys.stdin.buffer.raw
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.2)
        if readable and not stdin.read(4096):
            break
    # Skip the C++ destructors: the process ends, and with it every socket.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
