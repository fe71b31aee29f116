"""`pretrain sample`: text from a model, token by token, as it is made.

The samples of one or several prompts are made side by side in batches, each drawn from its own
seeded CPU generator (the same text for the same seed, in any batch and on any device, to the
model's rounding), ended after a number of tokens or before a stop string, and printed in order
as each is done; a sample made alone comes token by token. `print_samples` is the command: its
prompts (given, or one per line of a file), the model and tokenizer (`export.load_model`), the
samples on stdout and the rate on stderr.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from pretrain.config.tree import ModelConfig
from pretrain.data.tokenizer import HFTokenizer, Tokenizer
from pretrain.errors import ConfigError, DataError
from pretrain.export import load_model, tokenizer_for
from pretrain.training.model.gpt import GPT, KVCache

MAX_SAMPLE_TOKENS = 10_000_000  # what one `pretrain sample` generates at most, all samples together
_BATCH_BYTES = 1 << 30  # about the most a batch of samples side by side holds in activations
_BATCH_TOKENS = 1 << 16  # tokens a batch makes before its samples are printed: one sample past that


def sample_batch_size(m: ModelConfig, num_samples: int, max_new_tokens: int) -> int:
    """How many samples are generated side by side: as many as fit in _BATCH_BYTES of activations
    (a forward of a full context without gradients: embeddings, q/k/v, the MLP's hidden layer and
    the attention scores, twice over) and _BATCH_TOKENS tokens; at least one."""
    T = m.block_size
    per_sample = 4 * 2 * T * (4 * m.n_embd + m.ffn_hidden + m.n_head * T) + 4 * (m.vocab_size or 0)
    return max(1, min(num_samples, _BATCH_BYTES // per_sample, _BATCH_TOKENS // max_new_tokens))


class _Decoder:
    """A sample's text, token by token: a byte-level BPE token may end inside a character, which is
    held back until the next token completes it (and decoded as `decode` would, with U+FFFD for
    bytes that never form one).

    A Hugging Face tokenizer's decoder may read a token by its neighbours (a Llama "▁" is a space
    but at the start): its text is the decode of the tokens since the last piece's first, less that
    of the last piece's, as text-generation-inference streams it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        enc = getattr(tokenizer, "enc", None)  # tiktoken's, for the byte-level BPEs
        self.token_bytes = getattr(enc, "decode_single_token_bytes", None)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if self.token_bytes else None
        self.hf = isinstance(tokenizer, HFTokenizer)
        self.ids: list[int] = []  # an hf tokenizer's: the sample's tokens so far
        self.start = self.shown = 0  # ids[start:shown]: the last piece's tokens

    def __call__(self, ids: list[int]) -> str:
        if self.hf:
            self.ids += ids
            return self._hf_piece(final=False)
        if self.token_bytes is None or self.utf8 is None:
            return str(self.tokenizer.decode(ids))
        return str(self.utf8.decode(b"".join(self.token_bytes(i) for i in ids)))

    def _hf_piece(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.start : self.shown])
        now = self.tokenizer.decode(self.ids[self.start :])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):  # a byte of a character
            return ""
        self.start, self.shown = self.shown, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        if self.hf:
            return self._hf_piece(final=True)
        return "" if self.utf8 is None else str(self.utf8.decode(b"", final=True))


class _Continuation:
    """What a sample adds to its prompt, piece by piece, ended before the first stop string in it:
    `add` returns the text that can be shown now, holding back an end that may begin a stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.pending = ""  # made, not yet shown: no stop string begins before it
        self.done = False  # a stop string or the end-of-text came
        self.why = ""  # what ended it before max_new_tokens: "end-of-text", "--stop"
        self.made = 0  # tokens generated

    def add(self, text: str, final: bool = False) -> str:
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if found:
            self.done, self.why = True, "--stop"
            shown, self.pending = self.pending[: min(found)], ""
            return shown
        cut = len(self.pending) - (0 if final else self._held())
        shown, self.pending = self.pending[:cut], self.pending[cut:]
        return shown

    def _held(self) -> int:
        """The length of the longest end of `pending` that begins a stop string."""
        for n in range(min(len(self.pending), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.pending[-n:]) for s in self.stop):
                return n
        return 0


@dataclasses.dataclass
class SampleCount:
    """What a `stream_samples` has made so far: tokens generated, all samples together, and the
    samples that ended before max_new_tokens: sample index -> (why, tokens generated)."""

    tokens: int = 0
    ended: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)


def _next_tokens(
    logits: torch.Tensor, temperature: float, top_k: int | None, vocab: int, gens: list[torch.Generator]
) -> torch.Tensor:
    """One token for each row of the next-token `logits` (B, V), on the CPU, row r drawn with
    `gens[r]`, among the tokenizer's `vocab` ids only (a model's vocabulary may be padded past the
    tokenizer's). A temperature of 0 is greedy: the likeliest token, nothing drawn."""
    if temperature == 0:  # as transformers' do_sample=False: the first of equal maxima
        return logits[:, :vocab].to("cpu", torch.float64).argmax(dim=-1)
    # (B, vocab), drawn from on the CPU in float64 (a temperature of 1e-300 is not 0 there; MPS has no
    # float64): the same samples on every device, to the model's rounding.
    logits = logits[:, :vocab].to("cpu", torch.float64)
    # Shifted so that the likeliest is 0 before dividing: a tiny temperature is greedy, never 0/0.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    probs = torch.softmax(logits, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise DataError(
            "the model's next-token probabilities are not finite (its outputs overflowed to NaN or inf): "
            "sample another checkpoint, or on a GPU try --device cpu"
        )
    # Inverse-CDF sampling, one uniform number per row from its own (CPU) generator: the first token
    # whose cumulative probability exceeds it, never one of probability 0 (right=True).
    u = torch.tensor(
        [torch.rand((), generator=g, dtype=torch.float64).item() for g in gens], dtype=torch.float64
    )
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp_(max=probs.size(-1) - 1)


@torch.no_grad()
def stream_samples(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str | Sequence[str],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    num_samples: int = 1,
    *,
    stop: Sequence[str] = (),
    kv_cache: bool = True,
    count: SampleCount | None = None,
    prompt_names: Sequence[str] | None = None,
) -> Iterator[tuple[int, str]]:
    """Each sample's text, samples in order, as (sample index, piece): the prompt, then what follows
    it. With several prompts, prompt p's sample i is sample p * num_samples + i. Sample i of a prompt
    draws from its own CPU generator, seeded seed + i: the samples of a prompt among others are the
    ones it has alone, in any batch and on any device (to rounding).

    Samples whose prompts are as long (in tokens) are made side by side in batches
    (`sample_batch_size`), each batch's printed when it is done; a sample made alone (a long one)
    comes token by token, as it is made. A sample ends after max_new_tokens tokens, at the
    tokenizer's end-of-text (as transformers' generate with the export's generation_config), or
    before the first of the `stop` strings in what it adds to the prompt (neither is part of it);
    `count.ended` says which ended early, and why. A temperature of 0 is greedy.
    The context is the last block_size tokens, so memory stays bounded however long a sample is;
    the KV cache (`GPT.next_logits`) gives the tokens a forward of the whole context gives. A prompt
    the tokenizer refuses is named by `prompt_names` (by default `--prompt N`)."""
    device = next(model.parameters()).device
    _check_vocab(model, tokenizer)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    contexts = _contexts(tokenizer, prompts, model.cfg.block_size, prompt_names)
    samples = [(p, i) for p in range(len(prompts)) for i in range(num_samples)]  # sample k's prompt, i
    batch = sample_batch_size(model.cfg, len(samples), max_new_tokens)
    done: dict[int, str] = {}  # samples made and not yet printed: one before them is not made yet
    printed = 0
    for ks in _batches(samples, contexts, batch):
        live = ks == [printed]
        ended: dict[int, tuple[str, int]] = {}  # the batch's rows that ended early
        made = _sample_batch(
            model, tokenizer, [contexts[samples[k][0]] for k in ks], [seed + samples[k][1] for k in ks],
            max_new_tokens, temperature, top_k, stop, kv_cache, count, device, live, ended,
        )  # fmt: skip
        for r, text in made:
            if live:
                yield printed, text
            else:
                done[ks[r]] = done.get(ks[r], "") + text
        if count is not None:
            count.ended.update({ks[r]: why for r, why in ended.items()})
        printed += live
        while printed in done:
            yield printed, done.pop(printed)
            printed += 1


def _check_vocab(model: GPT, tokenizer: Tokenizer) -> None:
    """The tokenizer's ids are the model's: no more of them than the model has rows in its head."""
    vocab = tokenizer.vocab_size
    if vocab > model.lm_head.out_features:
        raise DataError(
            f"the tokenizer has {vocab} tokens, the model {model.lm_head.out_features}: not the model's "
            "tokenizer (check --tokenizer-path)"
        )


def _contexts(
    tokenizer: Tokenizer, prompts: list[str], block_size: int, prompt_names: Sequence[str] | None
) -> list[list[int]]:
    """Each prompt's last block_size tokens (end-of-text for an empty one); a prompt the tokenizer
    refuses is named by `prompt_names` (by default `--prompt N`)."""
    contexts = []
    for p, text in enumerate(prompts):
        try:
            ids = tokenizer.encode(text) or [tokenizer.eot_token or 0]
        except DataError as e:
            name = prompt_names[p] if prompt_names else f"--prompt{'' if len(prompts) == 1 else f' {p + 1}'}"
            raise DataError(f"{name}: {e}") from e
        contexts.append(ids[-block_size:])
    return contexts


def _batches(samples: list[tuple[int, int]], contexts: list[list[int]], batch: int) -> list[list[int]]:
    """The samples (by index) in batches of at most `batch`, each from contexts of one length."""
    # A batch's samples start from contexts of one length: one position (and cache position) for all.
    batches: list[list[int]] = []
    for n in dict.fromkeys(len(c) for c in contexts):  # the lengths, in the order of their first prompt
        same = [k for k, (p, _) in enumerate(samples) if len(contexts[p]) == n]
        batches += [same[j : j + batch] for j in range(0, len(same), batch)]
    return batches


def _sample_batch(
    model: GPT,
    tokenizer: Tokenizer,
    contexts: list[list[int]],
    seeds: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    stop: Sequence[str],
    kv_cache: bool,
    count: SampleCount | None,
    device: torch.device,
    live: bool,
    ended: dict[int, tuple[str, int]],
) -> Iterator[tuple[int, str]]:
    """The texts of one batch of samples from contexts of one length, as (row, piece): each row's
    whole at the end, or, `live`, the one row's piece by piece as its tokens come. The rows that
    end before max_new_tokens are put in `ended`, with why and their tokens."""
    m = model.cfg
    gens = [torch.Generator().manual_seed(s % 2**64) for s in seeds]
    decoders = [_Decoder(tokenizer) for _ in contexts]
    ends = [_Continuation(stop) for _ in contexts]
    texts = [d(c) for d, c in zip(decoders, contexts, strict=True)]
    if live:
        yield 0, texts[0]
        texts[0] = ""
    idx = torch.tensor(contexts, dtype=torch.long, device=device)  # (B, T)
    cache = KVCache(m.n_layer, m.block_size) if kv_cache else None
    rows = list(range(len(contexts)))  # the rows still generating, in idx's order
    for _ in range(max_new_tokens):
        gens_now = [gens[r] for r in rows]
        idx, nxt = _step(model, idx, cache, gens_now, temperature, top_k, tokenizer.vocab_size, count)
        for r, piece in _pieces(rows, nxt, decoders, ends, tokenizer.eot_token):
            if not live:
                texts[r] += piece
            elif piece:
                yield r, piece
        going = [j for j, r in enumerate(rows) if not ends[r].done]
        if not going:
            break
        idx, rows = _keep(idx, rows, going, cache)  # a stop string ended some samples: go on without them
    ended.update({r: (e.why, e.made) for r, e in enumerate(ends) if e.done})
    yield from _last_pieces(decoders, ends, texts, live)


def _step(
    model: GPT,
    idx: torch.Tensor,
    cache: KVCache | None,
    gens: list[torch.Generator],
    temperature: float,
    top_k: int | None,
    vocab: int,
    count: SampleCount | None,
) -> tuple[torch.Tensor, list[int]]:
    """One token more for each row of `idx` (B, T), drawn with its generator in `gens`: idx with them
    appended (its last block_size tokens), and the tokens."""
    nxt = _next_tokens(model.next_logits(idx, cache), temperature, top_k, vocab, gens)
    if count is not None:
        count.tokens += len(gens)
    idx = torch.cat((idx, nxt[:, None].to(idx.device)), dim=1)[:, -model.cfg.block_size :]
    return idx, nxt.tolist()


def _pieces(
    rows: list[int], tokens: list[int], decoders: list[_Decoder], ends: list[_Continuation], eot: int | None
) -> list[tuple[int, str]]:
    """What each row's new token adds to its text, as (row, piece): "" where nothing shows yet, and
    at the end-of-text `eot`, which ends the row (and is not shown)."""
    pieces = []
    for r, token in zip(rows, tokens, strict=True):
        ends[r].made += 1
        if token == eot:  # what the row holds back is its end: no stop string follows
            pieces.append((r, ends[r].add(decoders[r].flush(), final=True)))
            ends[r].done, ends[r].why = True, "end-of-text"
        else:
            pieces.append((r, ends[r].add(decoders[r]([token]))))
    return pieces


def _keep(
    idx: torch.Tensor, rows: list[int], going: list[int], cache: KVCache | None
) -> tuple[torch.Tensor, list[int]]:
    """The batch without its ended rows: only the `going` ones (positions in `rows`) of idx and cache."""
    if len(going) == len(rows):  # none ended
        return idx, rows
    keep = torch.tensor(going, device=idx.device)
    if cache is not None:
        cache.keep(keep)
    return idx[keep], [rows[j] for j in going]


def _last_pieces(
    decoders: list[_Decoder], ends: list[_Continuation], texts: list[str], live: bool
) -> Iterator[tuple[int, str]]:
    """The end of each row, what its decoder still held: (row, its whole text) or, `live`, the rest."""
    for r in range(len(decoders)):
        rest = "" if ends[r].done else ends[r].add(decoders[r].flush(), final=True)
        if not live:
            yield r, texts[r] + rest
        elif rest:
            yield r, rest


def generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str | Sequence[str],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    num_samples: int = 1,
    *,
    stop: Sequence[str] = (),
    kv_cache: bool = True,
) -> list[str]:
    """The samples of `stream_samples`, whole."""
    n = num_samples * (1 if isinstance(prompt, str) else len(prompt))
    texts = [""] * n
    for i, piece in stream_samples(
        model, tokenizer, prompt, max_new_tokens, temperature, top_k, seed, num_samples,
        stop=stop, kv_cache=kv_cache,
    ):  # fmt: skip
        texts[i] += piece
    return texts


# ---------------------------------------------------------------------------------------------
# `pretrain sample`


def print_samples(
    src: Path,
    *,
    prompt: Sequence[str] | None,
    prompt_file: str | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    num_samples: int,
    stop: Sequence[str] = (),
    kv_cache: bool = True,
    device: str = "cpu",
    tokenizer_path: str | None = None,
    checksums: bool = True,
) -> None:
    """`pretrain sample`: the samples of a checkpoint or an export on stdout, each printed as it
    comes (under a header where there are several), and the tokens/s on stderr."""
    prompts, names = read_prompts(prompt, prompt_file)
    _check_total(len(prompts), num_samples, max_new_tokens)
    check_device(device)
    model, cfg, where = load_model(src, device=device, checksums=checksums)
    tokenizer = tokenizer_for(where, cfg, tokenizer_path)
    count = SampleCount()
    samples = stream_samples(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        temperature,
        top_k,
        seed,
        num_samples,
        stop=stop,
        kv_cache=kv_cache,
        count=count,
        prompt_names=names,
    )
    start = time.perf_counter()
    try:
        _write_samples(samples, several_prompts=len(prompts) > 1, num_samples=num_samples)
    except BrokenPipeError:  # `pretrain sample ... | head`: the reader has what it wanted
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    except RuntimeError as e:  # out of memory on the device (torch.OutOfMemoryError) or the host
        if "out of memory" not in str(e) and "can't allocate memory" not in str(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            [f"--device {device}: out of memory generating ({first}); ask for fewer --num-samples"],
            "sample",
        ) from e
    seconds = time.perf_counter() - start
    print(
        f"{count.tokens:,} tokens in {seconds:.2f} s: {count.tokens / max(seconds, 1e-9):,.1f} tokens/s "
        f"({'with' if kv_cache else 'without'} the KV cache, --device {device})",
        file=sys.stderr,
    )
    if count.ended:
        print(_ended_line(count.ended, max_new_tokens, len(prompts) * num_samples), file=sys.stderr)


def _ended_line(ended: dict[int, tuple[str, int]], max_new_tokens: int, samples: int) -> str:
    """One line naming the samples that ended before --max-new-tokens, and why."""
    said = [
        (f"sample {k + 1} " if samples > 1 else "")
        + f"at {'the end-of-text token' if why == 'end-of-text' else 'a --stop string'} after {made:,} tokens"
        for k, (why, made) in sorted(ended.items())
    ]
    more = f", and {len(said) - 5} more" if len(said) > 5 else ""
    return f"ended before --max-new-tokens {max_new_tokens:,}: " + ", ".join(said[:5]) + more


def _write_samples(samples: Iterator[tuple[int, str]], *, several_prompts: bool, num_samples: int) -> None:
    """Each sample's pieces on stdout as they come, under a header naming it where there are several."""
    current = -1
    for i, piece in samples:  # printed as it comes: a sample made alone, token by token
        if i != current:
            if current >= 0:
                sys.stdout.write("\n")
            p, n = divmod(i, num_samples)  # prompt p's sample n
            heads = [f"prompt {p + 1}"] * several_prompts
            heads += [f"sample {n + 1}"] * (num_samples > 1)
            if heads:
                sys.stdout.write(f"--- {', '.join(heads)} ---\n")
            current = i
        sys.stdout.write(piece)
        sys.stdout.flush()
    print(flush=True)


def read_prompts(prompt: Sequence[str] | None, prompt_file: str | None) -> tuple[list[str], list[str] | None]:
    """--prompt's texts, or --prompt-file's lines, with the names an error gives them (None: `--prompt
    N`); a newline without either."""
    if prompt_file is None:
        return list(prompt or ["\n"]), None
    if prompt:
        raise ConfigError(
            ["--prompt and --prompt-file both given: give the prompts one way (--prompt for each, or "
             "one per line in --prompt-file)"],
            "sample",
        )  # fmt: skip
    path = Path(prompt_file)
    fix = "give a text file of prompts, one per line"
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file" if not path.exists() else "not a file"
        raise ConfigError([f"--prompt-file {path}: {what}; {fix}"], "sample")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"--prompt-file {path}: not UTF-8 text ({e}); save it as UTF-8"], "sample") from e
    except OSError as e:
        raise ConfigError(
            [f"--prompt-file {path}: cannot read it ({e.strerror or e}); {fix}"], "sample"
        ) from e
    prompts = text.splitlines()
    if not prompts:
        raise ConfigError([f"--prompt-file {path}: empty; write one prompt per line"], "sample")
    return prompts, [f"--prompt-file {path}, line {i}" for i in range(1, len(prompts) + 1)]


def _check_total(num_prompts: int, num_samples: int, max_new_tokens: int) -> None:
    """No more than MAX_SAMPLE_TOKENS tokens over all samples of all prompts."""
    if num_prompts * num_samples * max_new_tokens > MAX_SAMPLE_TOKENS:
        many = f"{num_prompts} prompts x " if num_prompts > 1 else ""
        raise ConfigError(
            [
                f"{many}--num-samples {num_samples} x --max-new-tokens {max_new_tokens} = "
                f"{num_prompts * num_samples * max_new_tokens:,} tokens: more than one `sample` "
                f"makes ({MAX_SAMPLE_TOKENS:,}); ask for fewer, or run it several times with other "
                "--seed values" + (" or prompts" if many else "")
            ],
            "sample",
        )


def check_device(name: str) -> None:
    """--device names a device this machine has, that computes ('meta' holds no values)."""
    try:
        device = torch.device(name)
        if device.type == "meta":
            raise ValueError("the meta device holds shapes, not values")
        torch.empty(0, device=device)
    except Exception as e:  # RuntimeError, NotImplementedError, AssertionError, ImportError: per backend
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        cuda = (
            f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        )
        raise ConfigError(
            [f"--device {name!r}: not usable here ({first}); this machine has {cuda}; try --device cpu"]
        ) from e
