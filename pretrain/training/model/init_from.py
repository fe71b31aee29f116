"""A run's initial weights from a local Hugging Face model directory (`model.init_from`).

The inverse of the export's mapping (export.hf_state_dict), for the three classes it writes, in its
layouts and in the originals, which are the same names: `GPT2LMHeadModel` (Conv1D weights stored
(in, out), transposed here; a tied head stored once), `GPTNeoXForCausalLM` (q, k and v interleaved
per head; sequential or parallel residual, rotary on the whole head or a share of it, as Pythia)
and `LlamaForCausalLM`
(q/k/v/o_proj, gate/up/down_proj). Hugging Face's Llama rotates the two halves of each head
(`rotate_half`), as our RoPE does, so q and k are taken as they are: no permutation.

Read with safetensors, never pickle, tensor by tensor: the files' headers give every shape, which
is checked against the model section before anything is loaded, every difference in one error.
Under ZeRO-3 rank 0 reads each tensor and writes it into its gathered parameter
(`GatheredParameters(modifier_rank=0)`), so no rank ever holds the whole model. Under tensor and
pipeline parallelism each rank reads only what it will hold (`load_shares`): a pipeline stage its
own layers, a tensor rank only the slices of each tensor that AutoTP leaves it (`tensor_share`),
each read as a slice of the file (`get_slice`), each our layout's rows or columns (`Layout`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import Tensor, nn

from pretrain.config.hf import INDEX, SHAPE_FIELDS, link_problem, read_config
from pretrain.config.hf import eps_of as _eps
from pretrain.config.hf import fail as _fail
from pretrain.config.tree import InitFromConfig, ModelConfig, RunConfig, required_vocab_size
from pretrain.data.dataset import resolve_vocab
from pretrain.errors import CheckpointError
from pretrain.training.model.gpt import GPT

WEIGHTS = "model.safetensors"
# Buffers older transformers versions saved beside the weights: derived, never loaded.
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".inv_freq")


@dataclass
class Source:
    """A Hugging Face directory, read as far as its headers: nothing loaded yet."""

    dir: Path
    architecture: str
    model: dict[str, Any]  # the ModelConfig fields config.json describes
    files: dict[str, Path]  # each tensor's file
    shapes: dict[str, tuple[int, ...]]
    export_info: dict[str, Any] | None  # pretrain.json, where the directory is an export's hf/
    # The first tensor read that holds a NaN or an inf: noted by the rank that read it, said by every
    # rank once the model is built (setup), as ranks read different tensors and none may stop alone.
    non_finite: str | None = None

    def error(self, problem: str) -> CheckpointError:
        return CheckpointError(f"model.init_from {self.dir}: {problem}")


def open_source(spec: InitFromConfig) -> Source:
    """The directory `spec.path` (an export directory stands for its hf/): its config.json, which
    class and shape it describes, and where and how large each tensor is. One CheckpointError for
    what cannot be used."""
    where, arch, model = read_config(spec.path)
    files = _weight_files(where)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with _opened(path, where) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if files.get(name) == path:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    missing = sorted(set(files) - set(shapes))
    if missing:
        raise _fail(where, f"{INDEX} names {', '.join(missing[:3])}, which its files do not hold")
    info = None
    if where.name == "hf" and (where.parent / "pretrain.json").is_file():
        try:
            info = json.loads((where.parent / "pretrain.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise _fail(where.parent, f"pretrain.json is not readable ({e}): export it again") from e
    return Source(where, arch, model, files, shapes, info if isinstance(info, dict) else None)


def _weight_files(where: Path) -> dict[str, Path]:
    """Each tensor's file: model.safetensors, or the shards model.safetensors.index.json maps (files
    of the directory; both there is refused, as is a link that loops or leads nowhere)."""
    for name, what in ((INDEX, "index"), (WEIGHTS, "weights")):
        if why := link_problem(where / name):
            raise _fail(where, f"{why}: point it at the model's {what} file, or put the file there")
    if (where / INDEX).is_file():
        files = _shards(where)
        others = sorted({p.name for p in files.values()} - {WEIGHTS})
        if (where / WEIGHTS).is_file() and others:
            raise _fail(
                where,
                f"holds both {WEIGHTS} and {INDEX} (which names {len(others)} other shards: "
                f"{', '.join(others[:2])}{', ...' if len(others) > 2 else ''}), two sets of weights: remove "
                "the one that is not the model's (save_pretrained writes one or the other)",
            )
        for path in sorted(set(files.values())):
            if why := link_problem(path):
                raise _fail(where, f"{INDEX} names {path.name}, and {why}: point it at the shard")
        absent = sorted({p.name for p in files.values() if not p.is_file()})
        if absent:
            raise _fail(where, f"{INDEX} names shards that are not there: {', '.join(absent[:3])}")
        return files
    if not (where / WEIGHTS).is_file():
        pickled = [p.name for p in where.glob("*.bin")]
        hint = (
            f" ({', '.join(pickled[:2])} is a pickle, which is never read: re-save with save_pretrained, whose "
            "default is safetensors)"
            if pickled
            else ""
        )
        raise _fail(where, f"holds no {WEIGHTS} and no {INDEX}{hint}")

    with _opened(where / WEIGHTS, where) as f:
        return dict.fromkeys(f.keys(), where / WEIGHTS)


def _shards(where: Path) -> dict[str, Path]:
    """The index's weight_map: each tensor's shard, a file of the directory. An entry that would
    leave it (an absolute path, a `..`) is refused by name, never opened."""
    try:
        weight_map = json.loads((where / INDEX).read_text(encoding="utf-8"))["weight_map"]
        entries = [(str(k), v) for k, v in weight_map.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _fail(where, f"{INDEX} is not a readable index (no weight_map: {e})") from e
    files = {}
    for name, shard in entries:
        if not isinstance(shard, str) or not shard.strip():
            raise _fail(where, f"{INDEX} maps {name} to {shard!r}, not a file name: save the model again")
        rel = PurePosixPath(shard)
        if rel.is_absolute() or ".." in rel.parts:
            raise _fail(
                where,
                f"{INDEX} maps {name} to {shard!r}, outside the directory: a shard is a file of the model's "
                "directory, named from it (no absolute path, no '..'); fix the index or save the model again",
            )
        files[name] = where / rel
    return files


@contextmanager
def _opened(path: Path, where: Path) -> Iterator[Any]:
    """safe_open(path), its own error (a truncated or damaged file) said as one CheckpointError."""
    from safetensors import safe_open

    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors' SafetensorError on a truncated or damaged header; OSError
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise _fail(
            where,
            f"{path.name} is not a readable safetensors file ({type(e).__name__}: {first}): truncated or "
            "damaged; copy or save it again",
        ) from e
    with f:
        yield f


def apply_config(cfg: RunConfig, source: Source) -> RunConfig:
    """`cfg` with its model's shape taken from the directory's config.json (`init_from.config`)."""
    m = cfg.model.model_dump()
    m.update({k: source.model[k] for k in SHAPE_FIELDS})
    try:
        model = ModelConfig.model_validate(m)
    except ValueError as e:  # pydantic's ValidationError: a shape our config refuses
        raise source.error(f"config.json gives a model section this config refuses: {e}") from e
    return cfg.model_copy(update={"model": model})


def open_checked(cfg: RunConfig, tokenizer: Any, fingerprint: str) -> tuple[RunConfig, Source]:
    """`cfg.model.init_from` read as far as its headers and checked against the run: `cfg` with the
    model's shape from config.json (where `config` is true) and its vocabulary resolved, and the
    directory, whose tokenizer (`check_tokenizer`) and tensors (`check`) are the run's."""
    assert cfg.model.init_from is not None
    source = open_source(cfg.model.init_from)
    if cfg.model.init_from.config:
        cfg = apply_config(cfg, source)
    check_tokenizer(source, tokenizer, fingerprint, cfg.data.tokenizer)
    cfg = resolve_vocab(cfg, tokenizer.vocab_size)
    check(source, cfg.model)
    return cfg, source


def check_tokenizer(source: Source, tokenizer: Any, fingerprint: str, kind: str) -> None:
    """The weights were trained with the run's tokenizer (of `fingerprint`, a `kind` tokenizer): an
    export's pretrain.json names its tokenizer, which must be the run's; any directory's
    vocabulary must hold the tokenizer's ids, and one of another size must have a tokenizer.json
    that gives the run's ids (a vocabulary of another size, unnamed, is another tokenizer's)."""
    info = source.export_info
    if info is not None and info.get("tokenizer_fingerprint") not in (None, fingerprint):
        theirs = (info.get("config") or {}).get("data", {}).get("tokenizer", "another")
        raise source.error(
            f"exported from a model trained with a {theirs} tokenizer (fingerprint "
            f"{str(info.get('tokenizer_fingerprint'))[:12]}), but the run's data uses a {kind} tokenizer "
            f"(fingerprint {fingerprint[:12]}): the weights' token ids mean other text. Set data.* to the "
            "dataset that model was trained on (its tokenizer), or init_from a model of this tokenizer"
        )
    vocab = source.model["vocab_size"]
    if vocab < tokenizer.vocab_size:
        raise source.error(
            f"its vocabulary has {vocab} tokens, the run's {kind} tokenizer {tokenizer.vocab_size}: not a model "
            "of this tokenizer. Set data.* to a dataset of the model's tokenizer, or init_from another model"
        )
    if info is None and (source.dir / "tokenizer.json").is_file():
        _same_ids(source, tokenizer, kind)
    elif info is None and vocab != tokenizer.vocab_size:
        raise source.error(
            f"its vocabulary has {vocab} tokens, the run's {kind} tokenizer {tokenizer.vocab_size}, and it has "
            f"no tokenizer.json to say its ids are this tokenizer's: ids 0..{tokenizer.vocab_size - 1} would be "
            "fed to it as its own tokens. Prepare the data with the model's tokenizer, or put the model's "
            "tokenizer.json beside its weights (its ids are then checked against the run's)"
        )


# Text both tokenizers encode, where the directory's own tokenizer.json can be read: words, digits,
# punctuation, spaces and a new line, where a BPE of another vocabulary gives other ids.
PROBE = "First Citizen:\nBefore we proceed any further, hear me speak. 0123456789 (the quick brown fox)"


def _same_ids(source: Source, tokenizer: Any, kind: str) -> None:
    """The directory's tokenizer.json (its own tokenizer) gives the run tokenizer's ids to the same
    text: else the weights' ids mean other text, and one CheckpointError says so."""
    from tokenizers import Tokenizer as HFTokenizer

    with contextlib.suppress(OSError):
        if getattr(tokenizer, "data", None) == (source.dir / "tokenizer.json").read_bytes():
            return  # the run's hf tokenizer, byte for byte
    try:
        theirs = HFTokenizer.from_file(str(source.dir / "tokenizer.json"))
    except Exception as e:  # tokenizers' own error on a file it cannot parse
        raise source.error(f"tokenizer.json cannot be read ({str(e)[:200]}): remove it or fix it") from e
    known = set(getattr(tokenizer, "chars", None) or PROBE)  # a char tokenizer knows only its own
    text = "".join(c for c in PROBE if c in known)
    ours = list(tokenizer.encode(text))
    got = theirs.encode(text, add_special_tokens=False).ids
    if got != ours:
        at = next(
            (i for i, (a, b) in enumerate(zip(ours, got, strict=False)) if a != b), min(len(ours), len(got))
        )
        raise source.error(
            f"its tokenizer.json encodes text to other ids than the run's {kind} tokenizer ({text[:40]!r}...: "
            f"token {at} is {got[at] if at < len(got) else 'missing'} there, {ours[at] if at < len(ours) else 'missing'} "
            "here): the weights' token ids mean other text. Prepare the data with the model's own tokenizer, or "
            "init_from a model of this one"
        )


# Reads `index` of a Hugging Face tensor (`safe_open(...).get_slice(name)[index]`): only that part.
Read = Callable[[str, tuple[slice, ...]], Tensor]
ALL = slice(None)


class Layout:
    """How Hugging Face tensors make one of our parameters: whole (`layout(*tensors)`), or a range of
    its rows or of its columns read as slices of those tensors (`rows`, `cols`), no more."""

    def __call__(self, *xs: Tensor) -> Tensor:
        return xs[0]

    def rows(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        return read(names[0], (slice(a, b),))

    def cols(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        return read(names[0], (ALL, slice(a, b)))


class Stacked(Layout):
    """The tensors one above the other: Llama's q, k, v projections; its gate and up projections."""

    def __init__(self, rows: list[int]) -> None:
        self.sizes = rows

    def __call__(self, *xs: Tensor) -> Tensor:
        return torch.cat(xs, dim=0)

    def rows(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        pieces, start = [], 0
        for name, size in zip(names, self.sizes, strict=True):
            lo, hi = max(a, start), min(b, start + size)
            if lo < hi:
                pieces.append(read(name, (slice(lo - start, hi - start),)))
            start += size
        return torch.cat(pieces, dim=0)

    def cols(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        return torch.cat([read(n, (ALL, slice(a, b))) for n in names], dim=0)


class Transposed(Layout):
    """GPT-2's Conv1D weight, stored (in, out): our rows are its columns."""

    def __call__(self, *xs: Tensor) -> Tensor:
        return xs[0].t()

    def rows(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        return read(names[0], (ALL, slice(a, b))).t()

    def cols(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        return read(names[0], (slice(a, b),)).t()


class NeoxQKV(Layout):
    """NeoX's fused q, k, v, interleaved per head ([q_h; k_h; v_h] for each head h): ours are [q; k; v]
    (all heads each)."""

    def __init__(self, n_head: int, head_size: int) -> None:
        self.nh, self.hs = n_head, head_size

    def __call__(self, *xs: Tensor) -> Tensor:
        x, nh, hs = xs[0], self.nh, self.hs
        return x.reshape(nh, 3, hs, *x.shape[1:]).transpose(0, 1).reshape(3 * nh * hs, *x.shape[1:])

    def rows(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        hs, d = self.hs, self.nh * self.hs
        if (a, b) == (0, 3 * d):
            return self(read(names[0], (ALL,)))
        if a % hs or b % hs:
            raise ValueError(f"rows {a}:{b} of a fused q, k, v split heads of {hs}")
        pieces = []
        for row in range(a, b, hs):  # our row `row` is part (q, k or v) `row // d` of head `row % d // hs`
            at = (row % d // hs * 3 + row // d) * hs
            pieces.append(read(names[0], (slice(at, at + hs),)))
        return torch.cat(pieces, dim=0)

    def cols(self, read: Read, names: list[str], a: int, b: int) -> Tensor:
        raise ValueError("a fused q, k, v is split by rows only")


SAME = Layout()

# Our parameter: its Hugging Face tensors and how they make it.
Recipe = tuple[list[str], Layout]


def recipes(m: ModelConfig, architecture: str) -> dict[str, Recipe]:
    """How each of our parameters (a GPT of config `m`, as named in its state_dict) is made from the
    tensors of `architecture`: the inverse of export.hf_state_dict. A bias our model lacks is not
    here (see `dropped`)."""
    d, nh, hs = m.n_embd, m.n_head, m.head_size
    out: dict[str, Recipe] = {}
    qkv, fc, t = Stacked([d, m.kv_heads * hs, m.kv_heads * hs]), Stacked([m.ffn_hidden] * 2), Transposed()
    neox_qkv = NeoxQKV(nh, hs)

    for i in range(m.n_layer):
        h = f"h.{i}."
        if architecture == "LlamaForCausalLM":
            o = f"model.layers.{i}."
            a, mlp = o + "self_attn.", o + "mlp."
            out[h + "ln_1.weight"] = ([o + "input_layernorm.weight"], SAME)
            out[h + "attn.c_attn.weight"] = (
                [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                qkv,
            )
            out[h + "attn.c_proj.weight"] = ([a + "o_proj.weight"], SAME)
            out[h + "ln_2.weight"] = ([o + "post_attention_layernorm.weight"], SAME)
            out[h + "mlp.c_fc.weight"] = ([mlp + "gate_proj.weight", mlp + "up_proj.weight"], fc)
            out[h + "mlp.c_proj.weight"] = ([mlp + "down_proj.weight"], SAME)
        elif architecture == "GPTNeoXForCausalLM":
            o = f"gpt_neox.layers.{i}."
            for ours, theirs in (
                ("ln_1", "input_layernorm"),
                ("attn.c_attn", "attention.query_key_value"),
                ("attn.c_proj", "attention.dense"),
                ("ln_2", "post_attention_layernorm"),
                ("mlp.c_fc", "mlp.dense_h_to_4h"),
                ("mlp.c_proj", "mlp.dense_4h_to_h"),
            ):
                fix = neox_qkv if ours == "attn.c_attn" else SAME
                out[f"{h}{ours}.weight"] = ([f"{o}{theirs}.weight"], fix)
                out[f"{h}{ours}.bias"] = ([f"{o}{theirs}.bias"], fix)
        else:  # GPT-2's Conv1D layers store weights as (in, out)
            o = f"transformer.h.{i}."
            for name in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
                out[f"{h}{name}.weight"] = ([f"{o}{name}.weight"], SAME if name.startswith("ln") else t)
                out[f"{h}{name}.bias"] = ([f"{o}{name}.bias"], SAME)
    prefix = {
        "LlamaForCausalLM": "model.",
        "GPTNeoXForCausalLM": "gpt_neox.",
        "GPT2LMHeadModel": "transformer.",
    }
    p = prefix[architecture]
    wte = {"LlamaForCausalLM": "embed_tokens", "GPTNeoXForCausalLM": "embed_in", "GPT2LMHeadModel": "wte"}
    ln_f = {"LlamaForCausalLM": "norm", "GPTNeoXForCausalLM": "final_layer_norm", "GPT2LMHeadModel": "ln_f"}
    out["wte.weight"] = ([f"{p}{wte[architecture]}.weight"], SAME)
    out["ln_f.weight"] = ([f"{p}{ln_f[architecture]}.weight"], SAME)
    if architecture != "LlamaForCausalLM":
        out["ln_f.bias"] = ([f"{p}{ln_f[architecture]}.bias"], SAME)
    if architecture == "GPT2LMHeadModel":
        out["wpe.weight"] = (["transformer.wpe.weight"], SAME)
    out["lm_head.weight"] = (
        ["embed_out.weight" if architecture == "GPTNeoXForCausalLM" else "lm_head.weight"],
        SAME,
    )
    if not m.bias:  # biases our model lacks: the export's zeros, checked and left out
        out = {k: v for k, v in out.items() if not k.endswith(".bias")}
    return out


def bias_names(architecture: str, m: ModelConfig) -> list[str]:
    """The Hugging Face biases a model without biases (`m.bias` false) leaves out: zeros to load."""
    every = recipes(m.model_copy(update={"bias": True}), architecture)
    return [name for k, (names, _) in every.items() if k.endswith(".bias") for name in names]


def _tied_head(source: Source, m: ModelConfig) -> bool:
    """The directory stores no head of its own: it is the embedding (a tied export, GPT-2's original)."""
    head = recipes(m, source.architecture)["lm_head.weight"][0][0]
    return head not in source.shapes


def _shape(model: dict[str, Any]) -> dict[str, Any]:
    """The fields of a model section that decide its weights and its logits, as they take effect."""
    m = dict(model)
    kv = m["n_kv_head"] or m["n_head"]
    ffn = m["intermediate_size"] or (
        4 * m["n_embd"] if m["arch"] == "gpt2" else 64 * math.ceil(8 * m["n_embd"] / 3 / 64)
    )
    shape = {k: m[k] for k in ("arch", "n_layer", "n_head", "n_embd", "position")}
    shape.update(n_kv_head=kv, intermediate_size=ffn)
    if m["position"] == "rope":
        shape["rope_theta"] = float(m["rope_theta"])
        shape["rotary_pct"] = float(m.get("rotary_pct", 1.0))
        shape["parallel_residual"] = bool(m.get("parallel_residual", False))
    else:  # learned positions: one embedding per position; RoPE runs at any context length
        shape["block_size"] = m["block_size"]
    if m["arch"] == "gpt2":
        shape["activation"] = m["activation"]
    shape["norm_eps"] = _eps(m.get("norm_eps", 1e-5))
    return shape


def check(source: Source, m: ModelConfig) -> None:
    """The model section `m` describes the directory's weights: every difference between config.json's
    shape and the section, every tensor missing or of the wrong shape, and every tensor the model
    leaves out that is not zero, in one error with the fix. Reads only those left-out tensors."""
    ours, theirs = _shape(m.model_dump()), _shape(source.model)
    differ = [k for k in ours if k in theirs and ours[k] != theirs[k]]
    problems = [f"model.{k} is {ours[k]!r}, config.json's {theirs[k]!r}" for k in differ]
    problems += [f"model.{k} is set, config.json has no {k}" for k in ours if k not in theirs]
    vocab = required_vocab_size(m)
    if source.model["vocab_size"] < vocab:
        problems.append(f"model.vocab_size is {vocab}, config.json's {source.model['vocab_size']}")
        differ.append("vocab_size")
    if m.bias and not source.model["bias"]:
        problems.append("model.bias is true, the weights have no biases")
        differ.append("bias")
    if m.tie_embeddings and not _tied_head(source, m):
        problems.append("model.tie_embeddings is true, the weights have a head of their own")
        differ.append("tie_embeddings")
    if not problems:
        problems = _tensor_problems(source, m)
    if problems:
        sets = (
            " ".join(f"model.{k}={_yaml(source.model[k])}" for k in differ)
            or "nothing else: the files disagree with config.json"
        )
        raise source.error(
            f"a {source.architecture} that the model section does not describe:\n  - "
            + "\n  - ".join(problems)
            + f"\nTake the shape from config.json with model.init_from.config=true, or set {sets}"
        )
    with ExitStack() as stack:
        _check_left_out(source, m, stack, {})


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _tensor_problems(source: Source, m: ModelConfig) -> list[str]:
    """Every tensor the model needs that is missing or makes the wrong shape, and every one it does not use."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in GPT(m).state_dict().items()}
    names = recipes(m, source.architecture)
    if _tied_head(source, m):
        names["lm_head.weight"] = names["wte.weight"]  # the head starts as the embedding
    problems = []
    for k, (hf, make) in names.items():
        absent = [n for n in hf if n not in source.shapes]
        if absent:
            problems.append(f"{', '.join(absent)} is missing (our {k})")
            continue
        try:
            with torch.device("meta"):
                got = tuple(make(*(torch.empty(source.shapes[n]) for n in hf)).shape)
        except RuntimeError:  # shapes that do not even combine
            got = tuple(source.shapes[hf[0]])
        if k in ("wte.weight", "lm_head.weight") and got[:1] == (source.model["vocab_size"],):
            got = (required_vocab_size(m), *got[1:])  # the rows past ours are checked to be zeros
        if got != want[k]:
            problems.append(f"{', '.join(hf)} make our {k} {list(got)}, the model's is {list(want[k])}")
    used = {n for hf, _ in names.values() for n in hf} | set(
        [] if m.bias else bias_names(source.architecture, m)
    )
    extra = sorted(n for n in source.shapes if n not in used and not n.endswith(_BUFFERS))
    if extra:
        problems.append(f"{', '.join(extra[:3])}{' and more' if len(extra) > 3 else ''}: not in our model")
    return problems


def _read(source: Source, name: str, stack: ExitStack, handles: dict[Path, Any]) -> Tensor:
    path = source.files[name]
    if path not in handles:
        handles[path] = stack.enter_context(_opened(path, source.dir))
    return _finite(source, name, handles[path].get_tensor(name))


def _finite(source: Source, name: str, x: Tensor) -> Tensor:
    """`x`, what was read of tensor `name`; the first one that holds a NaN or an inf is noted in
    `source.non_finite` (said by `finite_or_error` once every rank has read its part)."""
    if source.non_finite is None and x.is_floating_point() and not bool(torch.isfinite(x).all()):
        what = " and ".join(w for w, bad in (("NaN", x.isnan()), ("inf", x.isinf())) if bool(bad.any()))
        source.non_finite = (
            f"{source.files[name].name} holds {what} in {name}: weights that train to a non-finite loss. "
            "Save the model again from sound weights, or init_from another model"
        )
    return x


def finite_or_error(source: Source, noted: list[str | None]) -> None:
    """One CheckpointError where a rank noted a non-finite tensor (`noted`: every rank's
    `source.non_finite`, so that all stop alike); nothing where none did."""
    if said := next((n for n in noted if n), None):
        raise source.error(said)


def _check_left_out(source: Source, m: ModelConfig, stack: ExitStack, handles: dict[Path, Any]) -> None:
    """What the model leaves out is zeros: the embedding rows past its vocabulary (an export's rows for
    the Hugging Face tokenizer's added tokens), and the biases of a model without them."""
    vocab = required_vocab_size(m)
    recipe = recipes(m, source.architecture)
    names = [recipe["wte.weight"][0][0]] + ([] if _tied_head(source, m) else [recipe["lm_head.weight"][0][0]])
    for name in names:
        path = source.files[name]
        if path not in handles:
            handles[path] = stack.enter_context(_opened(path, source.dir))
        rows = handles[path].get_slice(name)[vocab:]
        if rows.numel() and bool(rows.any()):
            raise source.error(
                f"{name} has {rows.size(0)} rows past model.vocab_size ({vocab}) that are not zeros: set "
                f"model.vocab_size={vocab + rows.size(0)}"
            )
    if not m.bias:
        for name in bias_names(source.architecture, m):
            if name in source.shapes and bool(_read(source, name, stack, handles).any()):
                raise source.error(f"{name} is not zero, and model.bias is false: set model.bias=true")


def parameters(source: Source, m: ModelConfig) -> Iterator[tuple[str, Callable[[], Tensor]]]:
    """Our parameter names, each with how to read its tensor (float32, our layout) from the files.
    Valid while iterating."""
    vocab = required_vocab_size(m)
    names = recipes(m, source.architecture)
    if _tied_head(source, m):
        names["lm_head.weight"] = names["wte.weight"]
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for k, (hf, make) in names.items():

            def load(hf: list[str] = hf, make: Callable[..., Tensor] = make, k: str = k) -> Tensor:
                x = make(*(_read(source, n, stack, handles) for n in hf))
                if k in ("wte.weight", "lm_head.weight"):
                    x = x[:vocab]
                return x.float().contiguous()

            yield k, load


def state_dict(source: Source, m: ModelConfig) -> dict[str, Tensor]:
    """The whole state dict of a GPT of config `m` from the directory, checked first (`check`)."""
    check(source, m)
    sd = {k: load() for k, load in parameters(source, m)}
    finite_or_error(source, [source.non_finite])
    return sd


@torch.no_grad()
def load_into(model: nn.Module, source: Source, m: ModelConfig, *, zero3: bool) -> None:
    """Write the directory's weights into `model` (a whole GPT of config `m`; `check` passed on every
    rank). Under ZeRO-3 (`zero3`: built in zero.Init) each parameter is gathered on its own and rank 0
    alone reads its tensor and writes it, then DeepSpeed re-partitions it: one tensor at a time in
    memory. A tensor- or pipeline-parallel rank's layers take theirs through `load_shares`."""
    params = dict(model.named_parameters())  # a tied head is wte's weight: named once, as wte
    if zero3:
        import deepspeed
        import torch.distributed as tdist

        rank0 = tdist.get_rank() == 0
        loaders = parameters(source, m) if rank0 else ((k, None) for k in recipes(m, source.architecture))
        for k, load in loaders:
            if k not in params:
                continue
            with deepspeed.zero.GatheredParameters([params[k]], modifier_rank=0):
                if load is not None:
                    params[k].data.copy_(load())
        return
    load_shares(params, source, m)


# Our rows (ranges) or our columns (one range) of a parameter: (rows, None) or (None, cols).
Share = tuple[list[tuple[int, int]] | None, tuple[int, int] | None]


def tensor_share(name: str, m: ModelConfig, shape: tuple[int, ...], tensor: tuple[int, int]) -> Share:
    """The part of our parameter `name` (whole: of `shape`) that AutoTP leaves to tensor rank `tensor[1]`
    of `tensor[0]` (ds_render.autotp_layer_specs; export.merge_tensor_parallel puts the parts back
    together): of a column-parallel layer (the fused q/k/v and the MLP's input projection, weight and
    bias) the rank's rows of each sub-matrix (q, k, v; SwiGLU's gate, up), of a row-parallel one (the
    output projections' weights) the rank's columns; everything else whole."""
    n, r = tensor
    whole: Share = ([(0, shape[0])], None)
    if n == 1:
        return whole
    kv = m.kv_heads * m.head_size
    if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        parts = [m.n_embd, kv, kv]
    elif name.endswith(("mlp.c_fc.weight", "mlp.c_fc.bias")):
        parts = [m.ffn_hidden] * (2 if m.arch == "llama" else 1)
    elif name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
        w = shape[1] // n
        return None, (r * w, (r + 1) * w)
    else:
        return whole
    rows, start = [], 0
    for part in parts:
        w = part // n
        rows.append((start + r * w, start + (r + 1) * w))
        start += part
    return rows, None


@torch.no_grad()
def load_shares(
    params: Mapping[str, Tensor], source: Source, m: ModelConfig, tensor: tuple[int, int] = (1, 0)
) -> None:
    """Write the directory's weights into `params` (ours, by their names in GPT: the whole model, or a
    pipeline stage's layers), each parameter whole as built, before AutoTP shards it. With tensor
    parallelism (`tensor`: (degree, this rank's place in its tensor group)) only the rows or columns
    AutoTP will leave to this rank (`tensor_share`) are read, as slices of the files' tensors, and
    written in their places: what AutoTP cuts out for the rank is exactly its slice of each Hugging
    Face tensor, and the rest (this rank's initial weights) it drops. Loaded before
    `deepspeed.initialize`, so the optimizer's fp32 copies are made from these weights."""
    names = recipes(m, source.architecture)
    if _tied_head(source, m):
        names["lm_head.weight"] = names["wte.weight"]
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str, index: tuple[slice, ...]) -> Tensor:
            path = source.files[name]
            if path not in handles:
                handles[path] = stack.enter_context(_opened(path, source.dir))
            return _finite(source, name, handles[path].get_slice(name)[index])

        for k, p in params.items():
            hf, layout = names[k]
            rows, cols = tensor_share(k, m, tuple(p.shape), tensor)
            for a, b in rows or []:
                p[a:b].copy_(layout.rows(read, hf, a, b))
            if cols is not None:
                p[:, cols[0] : cols[1]].copy_(layout.cols(read, hf, *cols))
