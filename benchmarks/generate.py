"""Generation speed with and without the KV cache, on the CPU: tokens/s of `pretrain sample`'s path.

    .venv/bin/python benchmarks/generate.py [--presets small,medium] [--vocabs char,gpt2]
                                            [--new-tokens 256] [--repeats 3] [--threads 1]

For each preset and vocabulary, the preset's model with random weights (seeded): `char` is the
presets' own, tiny-shakespeare's 65 characters; `gpt2` is GPT-2's BPE with a 50304-row embedding
and head, which then hold most of the weights. Batch 1, greedy (top-k 1) from a one-token prompt,
through `stream_samples` as `pretrain sample` calls it: the prompt, then one token a step with the
cache; the whole context every step without it. The two are timed in alternating rounds in one
process (neither always first); the best round of each counts. Stops with an error unless both
give the same text in every round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.config.presets import build  # noqa: E402
from pretrain.data.tokenizer import CharTokenizer, TiktokenTokenizer, Tokenizer  # noqa: E402
from pretrain.generate import SampleCount, stream_samples  # noqa: E402
from pretrain.training.model.gpt import GPT  # noqa: E402

DATA = ROOT / "tests" / "data"  # offline: no download


def tokenizer(vocab: str) -> tuple[Tokenizer, int]:
    """The tokenizer and the model's vocabulary size."""
    if vocab == "char":
        chars = CharTokenizer.fit([(DATA / "tinyshakespeare.txt").read_text()])
        return chars, chars.vocab_size
    return TiktokenTokenizer(DATA / "tokenizers" / "gpt2.tiktoken"), 50304


def run(model: GPT, tok: Tokenizer, new_tokens: int, kv_cache: bool) -> tuple[str, int, float, float]:
    """The text and tokens of one greedy sample, and its wall and CPU seconds."""
    count = SampleCount()
    wall, cpu = time.perf_counter(), time.process_time()
    pieces = stream_samples(model, tok, "\n", new_tokens, 1.0, 1, 0, kv_cache=kv_cache, count=count)
    text = "".join(piece for _, piece in pieces)
    return text, count.tokens, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="small,medium", help="Presets, comma-separated.")
    ap.add_argument("--vocabs", default="char,gpt2", help="Vocabularies (char, gpt2), comma-separated.")
    ap.add_argument("--new-tokens", type=int, default=256, help="Tokens generated per sample.")
    ap.add_argument("--repeats", type=int, default=3, help="Alternating rounds; the best of each counts.")
    ap.add_argument("--threads", type=int, default=1, help="torch threads.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, vocab in [(p, v) for p in args.presets.split(",") for v in args.vocabs.split(",")]:
        tok, vocab_size = tokenizer(vocab)
        cfg = build(name, overrides=[f"model.vocab_size={vocab_size}", "model.dropout=0.0"], world_size=1)
        model = GPT(cfg.model).eval()
        for kv_cache in (True, False):  # warm-up: the first calls allocate
            run(model, tok, 8, kv_cache)
        wall = {True: float("inf"), False: float("inf")}
        cpu = dict(wall)
        texts: dict[bool, str] = {}
        for r in range(args.repeats):
            for kv_cache in (True, False) if r % 2 == 0 else (False, True):
                text, n, w, c = run(model, tok, args.new_tokens, kv_cache)
                if n != args.new_tokens or texts.setdefault(kv_cache, text) != text:
                    raise SystemExit(f"{name}, {vocab}: {n} tokens, or another text than the round before")
                wall[kv_cache], cpu[kv_cache] = min(wall[kv_cache], w), min(cpu[kv_cache], c)
        if texts[True] != texts[False]:
            raise SystemExit(f"{name}, {vocab}: the greedy text with the KV cache is not the text without it")
        print(f"{name}, {vocab}: the greedy texts are identical", file=sys.stderr, flush=True)
        m, k = cfg.model, args.new_tokens
        rows.append(
            f"| {name} ({m.n_layer}/{m.n_head}/{m.n_embd}) | {vocab} ({vocab_size}) | "
            f"{model.num_params() / 1e6:.1f}M | {k / wall[False]:,.1f} ({k / cpu[False]:,.1f}) | "
            f"{k / wall[True]:,.1f} ({k / cpu[True]:,.1f}) | {wall[False] / wall[True]:.1f}x "
            f"({cpu[False] / cpu[True]:.1f}x) |"
        )
    load = os.getloadavg()
    print(
        f"batch 1, greedy, {args.new_tokens} new tokens from a 1-token prompt (block_size {m.block_size}), fp32, "
        f"{args.threads} thread(s), best of {args.repeats}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print("tokens/s of wall time (per CPU second of this process)")
    print("| model | vocab | params | no cache | KV cache | speedup |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
