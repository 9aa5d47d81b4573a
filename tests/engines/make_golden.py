#!/usr/bin/env python3
"""Make golden KV-event payloads with the engines' own code.

Run by hand; the output under tests/fixtures/engine-events/ is committed.

    python3 tests/engines/make_golden.py [--wheel-dir DIR] [--out DIR]

For each engine (vLLM 0.33.0, vLLM 0.23.0, SGLang 0.5.23) this script

* reads the engine's own KV-event module straight out of its PyPI wheel
  (``vllm/distributed/kv_events.py``, ``sglang/srt/disaggregation/kv_events.py``)
  and executes it with minimal stand-ins for the engine-internal modules it
  imports (logger, config, network helpers), so only msgspec, pyzmq and
  pydantic are needed;
* for vLLM, also takes the functions that compute a block's published
  ``extra_keys`` (``generate_block_hash_extra_keys`` and its helpers, plus
  ``to_event_extra_keys`` on 0.33) out of the wheel's
  ``vllm/v1/core/kv_cache_utils.py`` and runs them on a stand-in ``Request``,
  so LoRA / cache-salt / multimodal extra keys have exactly the shape that
  version publishes;
* builds each case's events with the engine's own structs, filled the way the
  engine fills them (vLLM's BlockPool: ``group_idx`` from the KV cache group,
  ``kv_cache_spec_kind`` set by ``KVCacheManager.take_events``, one
  ``extra_keys`` entry per block even when it is None; SGLang: ``medium`` is a
  ``StorageMedium`` enum member, ``lora_id`` always None);
* encodes the engine's ``KVEventBatch`` with ``msgspec.msgpack.Encoder().encode``
  exactly as its publisher thread does, writes ``<case>.msgpack`` and a plain
  ``<case>.json`` of the expected content;
* cross-checks: decodes every payload generically and compares it with the
  JSON (omitted defaults filled in), and, unless ``--no-publisher-check``, runs
  the engine's own ``ZmqEventPublisher`` on an inproc endpoint and checks the
  payload it puts on the wire is byte-identical (cases with a dp rank only:
  the publisher fills in a missing rank).

Wheels: ``--wheel-dir`` must hold the three wheels; without it they are
fetched with ``pip download --no-deps`` into ``~/.cache/kvhint/engine-wheels``.
"""

from __future__ import annotations

import __future__
import argparse
import ast
import enum
import glob
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import types
import zipfile
from typing import Any

import msgspec

ENGINES = {
    "vllm-0.33.0": {"dist": "vllm", "version": "0.33.0", "family": "vllm"},
    "vllm-0.23.0": {"dist": "vllm", "version": "0.23.0", "family": "vllm"},
    "sglang-0.5.23": {"dist": "sglang", "version": "0.5.23", "family": "sglang"},
}

KV_EVENTS_PATH = {
    "vllm": "vllm/distributed/kv_events.py",
    "sglang": "sglang/srt/disaggregation/kv_events.py",
}
SGLANG_NETWORK_PATH = "sglang/srt/utils/network.py"
VLLM_KV_CACHE_UTILS_PATH = "vllm/v1/core/kv_cache_utils.py"

# Functions of kv_cache_utils.py that decide what a block's extra_keys are.
VLLM_EXTRA_KEY_FUNCS = [
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "to_event_extra_keys",  # 0.33 only (0.23 publishes the keys as they are)
]

TS = 1700000000.25
H_U64 = [18446744073709551557, 9223372036854775809, 42]
H_I64 = [-3, -9223372036854775807, 42]
H_BYTES = [hashlib.sha256(b"block-%d" % i).digest() for i in range(3)]

log = logging.getLogger("make_golden")


# --------------------------------------------------------------------------
# Wheels and module loading
# --------------------------------------------------------------------------


def find_wheel(wheel_dir: str, dist: str, version: str) -> str:
    pats = [f"{dist}-{version}-*.whl"]
    hits = sorted(p for pat in pats for p in glob.glob(os.path.join(wheel_dir, pat)))
    if not hits:
        raise FileNotFoundError(f"no {dist}=={version} wheel in {wheel_dir}")
    return hits[0]


def fetch_wheels(cache_dir: str) -> str:
    os.makedirs(cache_dir, exist_ok=True)
    for meta in ENGINES.values():
        try:
            find_wheel(cache_dir, meta["dist"], meta["version"])
            continue
        except FileNotFoundError:
            pass
        spec = f"{meta['dist']}=={meta['version']}"
        print(f"downloading {spec} into {cache_dir}", file=sys.stderr)
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", cache_dir, spec]
        )
    return cache_dir


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_from_wheel(wheel: str, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode("utf-8")


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []  # let it act as a package for dotted children
    return mod


class _StubKVEventsConfig:
    """Stand-in for vllm.config.kv_events.KVEventsConfig (a pydantic dataclass
    in vLLM). The publisher only constructs it to report its configuration."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def _stub_get_ip() -> str:
    return "127.0.0.1"


def _stub_get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _stub_split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, rest = path.split("://", 1)
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port


def vllm_stubs() -> dict[str, types.ModuleType]:
    """Engine-internal modules vllm/distributed/kv_events.py imports."""
    return {
        "vllm": _stub("vllm"),
        "vllm.logger": _stub("vllm.logger", init_logger=logging.getLogger),
        "vllm.config": _stub("vllm.config"),
        "vllm.config.kv_events": _stub(
            "vllm.config.kv_events", KVEventsConfig=_StubKVEventsConfig
        ),
        "vllm.utils": _stub("vllm.utils"),
        "vllm.utils.network_utils": _stub(
            "vllm.utils.network_utils",
            get_ip=_stub_get_ip,
            get_tcp_uri=_stub_get_tcp_uri,
            is_valid_ipv6_address=lambda ip: ":" in ip,
            split_zmq_path=_stub_split_zmq_path,
        ),
        "vllm.v1": _stub("vllm.v1"),
        "vllm.v1.core": _stub("vllm.v1.core"),
        # Same definition as the wheel's kv_cache_utils.py (asserted below).
        "vllm.v1.core.kv_cache_utils": _stub(
            "vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int
        ),
    }


class _Parallel:
    pp_rank = 0
    attn_tp_rank = 0
    attn_cp_rank = 0


def sglang_stubs() -> dict[str, types.ModuleType]:
    """Engine-internal modules sglang/srt/disaggregation/kv_events.py imports.
    sglang.srt.utils.network is the wheel's own file (loaded separately);
    runtime_context is only used by is_kv_publisher_rank()."""
    return {
        "sglang": _stub("sglang"),
        "sglang.srt": _stub("sglang.srt"),
        "sglang.srt.utils": _stub("sglang.srt.utils"),
        "sglang.srt.disaggregation": _stub("sglang.srt.disaggregation"),
        "sglang.srt.runtime_context": _stub(
            "sglang.srt.runtime_context", get_parallel=lambda: _Parallel()
        ),
    }


def exec_module(name: str, source: str, filename: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = filename
    sys.modules[name] = mod
    exec(compile(source, filename, "exec"), mod.__dict__)
    return mod


def load_engine(engine: str, wheel: str) -> types.SimpleNamespace:
    """Load one engine's kv_events module from its wheel. Stubs are put into
    sys.modules only while the module executes, then removed, so two vLLM
    versions can be loaded in one process."""
    meta = ENGINES[engine]
    family = meta["family"]
    stubs = vllm_stubs() if family == "vllm" else sglang_stubs()
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    extra = {}
    try:
        if family == "sglang":
            net_src = read_from_wheel(wheel, SGLANG_NETWORK_PATH)
            net = exec_module(
                "sglang.srt.utils.network", net_src, f"{wheel}!{SGLANG_NETWORK_PATH}"
            )
            sys.modules["sglang.srt.utils"].network = net
        src = read_from_wheel(wheel, KV_EVENTS_PATH[family])
        modname = KV_EVENTS_PATH[family][:-3].replace("/", ".")
        mod = exec_module(modname, src, f"{wheel}!{KV_EVENTS_PATH[family]}")
        if family == "vllm":
            kcu_src = read_from_wheel(wheel, VLLM_KV_CACHE_UTILS_PATH)
            if "ExternalBlockHash: TypeAlias = bytes | int" not in kcu_src:
                raise RuntimeError(f"{engine}: ExternalBlockHash is no longer bytes | int")
            extra = load_extra_key_funcs(kcu_src, f"{wheel}!{VLLM_KV_CACHE_UTILS_PATH}")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        for k in ("sglang.srt.utils.network", "vllm.distributed.kv_events",
                  "sglang.srt.disaggregation.kv_events"):
            sys.modules.pop(k, None)
    return types.SimpleNamespace(engine=engine, family=family, mod=mod, wheel=wheel, **extra)


def load_extra_key_funcs(source: str, filename: str) -> dict[str, Any]:
    """Pull the extra-key functions out of vllm/v1/core/kv_cache_utils.py and
    run them in a small namespace (annotations left unevaluated)."""
    tree = ast.parse(source)
    wanted = [
        n for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name in VLLM_EXTRA_KEY_FUNCS
    ]
    module = ast.Module(body=wanted, type_ignores=[])
    code = compile(module, filename, "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)

    def tensor_data(_t: Any) -> bytes:  # only reached with prompt embeds
        raise NotImplementedError

    ns: dict[str, Any] = {"hashlib": hashlib, "Any": Any, "tensor_data": tensor_data}
    exec(code, ns)
    found = {n.name for n in wanted}
    return {"extra_key_funcs": {k: ns[k] for k in found}}


# --------------------------------------------------------------------------
# vLLM: what BlockPool publishes
# --------------------------------------------------------------------------


def vllm_request(tokens: list[int], *, lora: tuple[str, int, str] | None = None,
                 cache_salt: str | None = None,
                 mm: list[tuple[str, int, int]] | None = None) -> Any:
    """Stand-in for vllm.v1.request.Request with the attributes the extra-key
    functions read. mm: (identifier, offset, length) per multimodal item."""
    lora_request = None
    if lora is not None:
        name, int_id, path = lora
        # vllm.lora.request.LoRARequest: .name and .adapter_id are properties
        # returning lora_name and lora_int_id.
        lora_request = types.SimpleNamespace(
            lora_name=name, lora_int_id=int_id, lora_path=path, name=name, adapter_id=int_id
        )
    mm_features = [
        types.SimpleNamespace(
            identifier=ident, mm_position=types.SimpleNamespace(offset=off, length=length)
        )
        for ident, off, length in (mm or [])
    ]
    return types.SimpleNamespace(
        all_token_ids=tokens, lora_request=lora_request, cache_salt=cache_salt,
        mm_features=mm_features, prompt_embeds=None, session_id=None,
        _prompt_embeds_per_block_hashes={},
    )


def vllm_published_extra_keys(eng: Any, request: Any, first_block: int, n_blocks: int,
                              block_size: int) -> Any:
    """BlockPool.cache_full_blocks' extra-key loop, with the engine's own
    generate_block_hash_extra_keys (and to_event_extra_keys on 0.33)."""
    f = eng.extra_key_funcs
    keys = []
    curr_mm_idx = 0
    for i in range(first_block, first_block + n_blocks):
        start = i * block_size
        k, curr_mm_idx = f["generate_block_hash_extra_keys"](
            request, start, start + block_size, curr_mm_idx
        )
        keys.append(k)
    if "to_event_extra_keys" in f:  # vLLM >= 0.24-ish: tagged internally, untagged on the wire
        return f["to_event_extra_keys"](keys)
    return keys if keys else None  # vLLM 0.23: extra_keys_list if extra_keys_list else None


def vllm_stored(eng: Any, *, hashes: list, parent: Any, tokens: list[int], block_size: int,
                medium: str = "GPU", request: Any = None, first_block: int = 0,
                group_idx: int = 0, kind: str | None = "full_attention",
                sliding_window: int | None = None, extra_keys: Any = "auto",
                **more: Any) -> Any:
    m = eng.mod
    if request is None:
        request = vllm_request(tokens)
    if extra_keys == "auto":
        extra_keys = vllm_published_extra_keys(
            eng, request, first_block, len(hashes), block_size
        )
    lr = request.lora_request
    ev = m.BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=lr.adapter_id if lr else None,
        medium=medium,
        lora_name=lr.name if lr else None,
        extra_keys=extra_keys,
        group_idx=group_idx,
        **more,
    )
    # KVCacheManager.take_events() annotates BlockPool's stores per group.
    ev.kv_cache_spec_kind = kind
    ev.kv_cache_spec_sliding_window = sliding_window
    return ev


def vllm_has(eng: Any, cls: str, field: str) -> bool:
    return field in getattr(eng.mod, cls).__struct_fields__


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------


def batch(eng: Any, events: list, dp_rank: int | None) -> Any:
    m = eng.mod
    if eng.family == "vllm":
        return m.KVEventBatch(ts=TS, events=events, data_parallel_rank=dp_rank)
    return m.KVEventBatch(ts=TS, events=events, attn_dp_rank=dp_rank)


def chain_events(eng: Any, h: list) -> list:
    """The u64/i64/bytes shape: 2-block root store, 1-block child store,
    remove of the child, clear."""
    m = eng.mod
    if eng.family == "vllm":
        req = vllm_request(list(range(48)))
        return [
            vllm_stored(eng, hashes=h[:2], parent=None, tokens=list(range(32)),
                        block_size=16, request=req, first_block=0),
            vllm_stored(eng, hashes=h[2:3], parent=h[1], tokens=list(range(32, 48)),
                        block_size=16, request=req, first_block=2),
            # BlockPool emits one BlockRemoved per evicted block, with its group.
            m.BlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=0),
            m.AllBlocksCleared(),
        ]
    gpu = m.StorageMedium.GPU
    return [
        m.BlockStored(block_hashes=h[:2], parent_block_hash=None, token_ids=list(range(32)),
                      block_size=16, lora_id=None, medium=gpu),
        m.BlockStored(block_hashes=h[2:3], parent_block_hash=h[1],
                      token_ids=list(range(32, 48)), block_size=16, lora_id=None, medium=gpu),
        m.BlockRemoved(block_hashes=[h[2]], medium=gpu),
        m.AllBlocksCleared(),
    ]


def case_u64(eng):
    return batch(eng, chain_events(eng, H_U64), 0), []


def case_i64(eng):
    return batch(eng, chain_events(eng, H_I64), 0), []


def case_bytes(eng):
    if eng.family != "vllm":
        return None, ["SGLang's BlockStored.block_hashes is list[int]; no bytes hashes"]
    return batch(eng, chain_events(eng, H_BYTES), 0), []


def case_lora_salt(eng):
    m = eng.mod
    tokens = list(range(100, 132))
    if eng.family == "vllm":
        req = vllm_request(tokens, lora=("adapter-a", 7, "/adapters/adapter-a"),
                           cache_salt="salt-1")
        ev = vllm_stored(eng, hashes=[1001, 1002], parent=None, tokens=tokens,
                         block_size=16, request=req)
        return batch(eng, [ev], 0), []
    ev = m.BlockStored(block_hashes=[1001, 1002], parent_block_hash=None, token_ids=tokens,
                       block_size=16, lora_id=None, medium=m.StorageMedium.GPU,
                       cache_salt="salt-1", lora_name="adapter-a")
    return batch(eng, [ev], 0), []


MM_ID = hashlib.sha256(b"image-0").hexdigest()


def case_multimodal(eng):
    if eng.family != "vllm":
        return None, ["SGLang's BlockStored has no extra_keys / multimodal field"]
    tokens = list(range(200, 216))
    # One image whose 8 placeholder tokens start at position 4 of the block.
    req = vllm_request(tokens, mm=[(MM_ID, 4, 8)])
    ev = vllm_stored(eng, hashes=[2001], parent=None, tokens=tokens, block_size=16,
                     request=req)
    return batch(eng, [ev], 0), []


def case_media_and_groups(eng):
    m = eng.mod
    notes = []
    t1, t2, t3 = (list(range(s, s + 16)) for s in (300, 400, 500))
    if eng.family == "vllm":
        if vllm_has(eng, "BlockStored", "locality"):
            # 0.33 OffloadingConnector (offloading/events.py, self-describing
            # events on): the primary-tier metadata with extra_keys=None
            # (to_event_extra_keys(None)) and the group's spec.
            evs = [vllm_stored(eng, hashes=[3001], parent=None, tokens=t1, block_size=16,
                               medium="CPU", extra_keys=None)]
        else:
            # 0.23 OffloadingConnector (offloading/scheduler.py take_events):
            # no tokens, block_size 0, no group. (Real 0.23 CPU events carry
            # the raw 32-byte digest here, not an int: get_offload_block_hash
            # is not passed through maybe_convert_block_hash.)
            evs = [m.BlockStored(block_hashes=[3001], parent_block_hash=None, token_ids=[],
                                 lora_id=None, block_size=0, medium="CPU", lora_name=None)]
            notes.append("3001 (CPU) has the 0.23 OffloadingConnector shape: token_ids [], "
                         "block_size 0, no group_idx")
        if vllm_has(eng, "BlockStored", "kv_cache_spec_sliding_window"):
            evs.append(vllm_stored(eng, hashes=[3002], parent=None, tokens=t2,
                                   block_size=16, group_idx=1, kind="sliding_window",
                                   sliding_window=128))
        else:
            notes.append("no kv_cache_spec_sliding_window field: 3002 skipped")
        more = {}
        for f, v in (("locality", "LOCAL"), ("ownership", "kvcr"), ("session_id", "s1")):
            if vllm_has(eng, "BlockStored", f):
                more[f] = v
            else:
                notes.append(f"BlockStored has no {f}: left out of 3003")
        evs.append(vllm_stored(eng, hashes=[3003], parent=None, tokens=t3, block_size=16,
                               group_idx=0, kind="full_attention", **more))
        return batch(eng, evs, 0), notes
    sm = m.StorageMedium
    evs = [
        m.BlockStored(block_hashes=[3001], parent_block_hash=None, token_ids=t1,
                      block_size=16, lora_id=None, medium=sm.CPU),
        m.BlockStored(block_hashes=[3003], parent_block_hash=None, token_ids=t3,
                      block_size=16, lora_id=None, medium=sm.GPU, session_id="s1"),
    ]
    notes.append("SGLang has no group_idx/kv_cache_spec_*/locality/ownership: 3002 skipped, "
                 "3003 carries session_id only")
    return batch(eng, evs, 0), notes


def case_dp_rank(eng):
    return batch(eng, chain_events(eng, H_U64)[:1], 3), []


def case_dp_rank_none(eng):
    return batch(eng, chain_events(eng, H_U64)[:1], None), []


def case_block_size_32(eng):
    m = eng.mod
    tokens = list(range(32))
    if eng.family == "vllm":
        ev = vllm_stored(eng, hashes=[77], parent=None, tokens=tokens, block_size=32)
    else:
        ev = m.BlockStored(block_hashes=[77], parent_block_hash=None, token_ids=tokens,
                           block_size=32, lora_id=None, medium=m.StorageMedium.GPU)
    return batch(eng, [ev], 0), []


CASES = {
    "u64": case_u64,
    "i64": case_i64,
    "bytes": case_bytes,
    "lora-salt": case_lora_salt,
    "multimodal": case_multimodal,
    "media-and-groups": case_media_and_groups,
    "dp-rank": case_dp_rank,
    "dp-rank-none": case_dp_rank_none,
    "block-size-32": case_block_size_32,
}


# --------------------------------------------------------------------------
# Plain JSON and checks
# --------------------------------------------------------------------------


def plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"bytes_hex": v.hex()}
    if isinstance(v, enum.Enum):
        return plain(v.value)
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v


def event_json(ev: Any) -> dict:
    out = {"type": type(ev).__name__}
    for f in type(ev).__struct_fields__:
        out[f] = plain(getattr(ev, f))
    return out


def batch_json(engine: str, case: str, b: Any) -> dict:
    rank = b.data_parallel_rank if hasattr(b, "data_parallel_rank") else b.attn_dp_rank
    return {"engine": engine, "case": case, "ts": b.ts, "dp_rank": rank,
            "events": [event_json(e) for e in b.events]}


def struct_defaults(cls: Any) -> dict:
    fields = cls.__struct_fields__
    defaults = cls.__struct_defaults__
    return dict(zip(fields[len(fields) - len(defaults):], defaults))


def decode_generic(eng: Any, payload: bytes) -> tuple[dict, dict]:
    """Decode the payload with no schema, fill omitted defaults from the
    engine's structs, return (plain content, wire description)."""
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) in (2, 3), raw
    wire: dict[str, Any] = {"batch_array_len": len(raw), "events": []}
    events = []
    m = eng.mod
    for e in raw[1]:
        if isinstance(e, dict):
            tag = e["type"]
            cls = getattr(m, tag)
            present = [k for k in e if k != "type"]
            vals = {k: e[k] for k in present}
            enc = "map"
        else:
            assert isinstance(e, list), e
            tag = e[0]
            cls = getattr(m, tag)
            present = list(cls.__struct_fields__[: len(e) - 1])
            vals = dict(zip(present, e[1:]))
            enc = "array"
        defaults = struct_defaults(cls)
        full = {"type": tag}
        for f in cls.__struct_fields__:
            full[f] = plain(vals[f]) if f in vals else plain(defaults[f])
        events.append(full)
        omitted = [f for f in cls.__struct_fields__ if f not in vals]
        wire["events"].append({"type": tag, "encoding": enc, "omitted": omitted})
    content = {"ts": raw[0], "dp_rank": raw[2] if len(raw) == 3 else None, "events": events}
    return content, wire


def publisher_payload(eng: Any, b: Any, endpoint: str) -> bytes:
    """Run the engine's own ZmqEventPublisher on inproc and capture the
    payload frame it sends."""
    import zmq

    m = eng.mod
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    rank = b.data_parallel_rank if eng.family == "vllm" else b.attn_dp_rank
    if eng.family == "vllm":
        pub = m.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="golden")
    else:
        pub = m.ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, topic="golden")
    try:
        sub.connect(endpoint)
        time.sleep(0.2)  # let the subscription reach the PUB socket
        # publish() would fill a None rank from the publisher; ranks here are set.
        assert rank is not None
        pub.publish(b)
        if not sub.poll(5000):
            raise RuntimeError(f"{eng.engine}: publisher sent nothing")
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"golden" and seq == (0).to_bytes(8, "big"), (topic, seq)
        return payload
    finally:
        pub.shutdown()
        sub.close(linger=0)


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel-dir", help="directory holding the three wheels "
                    "(default: pip download --no-deps into ~/.cache/kvhint/engine-wheels)")
    ap.add_argument("--out", default=os.path.join(here, "..", "fixtures", "engine-events"))
    ap.add_argument("--no-publisher-check", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    wheel_dir = args.wheel_dir or fetch_wheels(
        os.path.join(os.path.expanduser("~"), ".cache", "kvhint", "engine-wheels")
    )
    out_root = os.path.normpath(args.out)
    summary = {"msgspec": msgspec.__version__, "engines": {}}
    n_inproc = 0
    for engine, meta in ENGINES.items():
        wheel = find_wheel(wheel_dir, meta["dist"], meta["version"])
        eng = load_engine(engine, wheel)
        summary["engines"][engine] = {"wheel": os.path.basename(wheel),
                                      "sha256": sha256_file(wheel), "cases": {}}
        out_dir = os.path.join(out_root, engine)
        os.makedirs(out_dir, exist_ok=True)
        encoder = msgspec.msgpack.Encoder()  # as in the publisher thread
        for case, fn in CASES.items():
            b, notes = fn(eng)
            for n in notes:
                print(f"note: {engine} {case}: {n}")
            if b is None:
                summary["engines"][engine]["cases"][case] = {"skipped": notes}
                continue
            expected = batch_json(engine, case, b)  # before publish() could touch it
            payload = encoder.encode(b)
            content, wire = decode_generic(eng, payload)
            for k in ("ts", "dp_rank", "events"):
                if content[k] != expected[k]:
                    raise RuntimeError(f"{engine} {case}: generic decode differs in {k}:\n"
                                       f"{content[k]}\n!=\n{expected[k]}")
            expected["wire"] = wire
            if not args.no_publisher_check and expected["dp_rank"] is not None:
                n_inproc += 1
                sent = publisher_payload(eng, b, f"inproc://golden-{n_inproc}")
                if sent != payload:
                    raise RuntimeError(f"{engine} {case}: publisher bytes differ")
            with open(os.path.join(out_dir, f"{case}.msgpack"), "wb") as f:
                f.write(payload)
            with open(os.path.join(out_dir, f"{case}.json"), "w") as f:
                json.dump(expected, f, indent=1)
                f.write("\n")
            summary["engines"][engine]["cases"][case] = {
                "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                "notes": notes,
            }
            print(f"wrote {engine}/{case}.msgpack ({len(payload)} bytes)")
    with open(os.path.join(out_root, "manifest.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
