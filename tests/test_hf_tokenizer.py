"""data.tokenizer=hf: a Hugging Face tokenizer.json as the data tokenizer, built here with
`tokenizers` (a GPT-NeoX-style byte-level BPE and a Llama-style byte-fallback BPE), through prepare,
the dataset's record, a short run, its export and init_from."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.config.tree import DataConfig, InitFromConfig, RunConfig, validate
from pretrain.data.dataset import MANIFEST, SPLITS, TOKENIZER_FILE, load_manifest
from pretrain.data.prepare import prepare
from pretrain.data.shards import open_shard
from pretrain.data.tokenizer import HF_TOKENIZER_FILE, HFTokenizer, load_tokenizer
from pretrain.errors import CheckpointError, ConfigError, DataError
from pretrain.export import tokenizer_origin, write_hf
from pretrain.training.model import init_from
from pretrain.training.model.gpt import GPT
from tests.conftest import TINY_SHAKESPEARE, cli

TEXT = TINY_SHAKESPEARE.read_text(encoding="utf-8")[:100_000]


def neox_tokenizer(out: Path) -> Path:
    """GPT-NeoX style: byte-level BPE, <|endoftext|> its one special token."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([TEXT], trainer)
    out.mkdir()
    hf.save(str(out / "tokenizer.json"))
    return out


# Llama 2's tokenizer_config.json, less its model_max_length: <s> its bos, no pad, right padding.
LLAMA_CONFIG = {
    "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "clean_up_tokenization_spaces": False,
    "eos_token": "</s>", "legacy": False, "pad_token": None, "padding_side": "right",
    "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False,
}  # fmt: skip
LLAMA_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"


def llama_tokenizer(out: Path) -> Path:
    """Llama (2) style: BPE with byte fallback over "▁"-spaced words, <unk> <s> </s>, and Llama 2's
    tokenizer files beside it: a tokenizer_config.json naming <s> its bos and </s> its eos (no
    model_max_length), special_tokens_map.json and a chat template."""
    hf = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[*specials, *(f"<0x{b:02X}>" for b in range(256))],
        show_progress=False,
    )
    hf.train_from_iterator([TEXT], trainer)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out.mkdir()
    hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(LLAMA_SPECIALS, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A JSON Lines corpus of the sample's distinct paragraphs, one a document."""
    docs = list(dict.fromkeys(p for p in TEXT.split("\n\n") if p.strip()))[:300]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path, docs


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"neox": neox_tokenizer(root / "neox"), "llama": llama_tokenizer(root / "llama")}


def data_config(corpus: Path, tok_dir: Path, out: Path) -> DataConfig:
    return DataConfig(
        corpus=str(corpus), tokenizer="hf", tokenizer_path=str(tok_dir), dataset_dir=str(out), workers=0
    )


@pytest.mark.parametrize("kind,eos", [("neox", "<|endoftext|>"), ("llama", "</s>")])
def test_prepare_gives_each_documents_ids_then_eos(kind, eos, tokenizers_, corpus, tmp_path):
    """Every document's shard tokens are the tokenizer's own ids (no <s> added) and its eos; the
    record keeps the tokenizer.json byte for byte and reads back with the same fingerprint."""
    path, docs = corpus
    hf = Tokenizer.from_file(str(tokenizers_[kind] / "tokenizer.json"))
    out = prepare(data_config(path, tokenizers_[kind], tmp_path / "ds"))
    tok = load_tokenizer(out / TOKENIZER_FILE)
    assert isinstance(tok, HFTokenizer) and tok.eos == eos and tok.eot_token == hf.token_to_id(eos)
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True) == 512
    original = (tokenizers_[kind] / "tokenizer.json").read_bytes()
    assert (out / HF_TOKENIZER_FILE).read_bytes() == original
    assert tok.fingerprint() == HFTokenizer.from_path(tokenizers_[kind]).fingerprint()
    assert load_manifest(out)["tokenizer"]["fingerprint"] == tok.fingerprint()
    stream = np.concatenate(
        [np.asarray(open_shard(out / e["path"])) for s in SPLITS for e in load_manifest(out)[s]]
    ).tolist()
    assert stream[-1] == tok.eot_token
    got, start = [], 0
    for i, t in enumerate(stream):
        if t == tok.eot_token:
            got.append(tuple(stream[start:i]))
            start = i + 1
    want = [tuple(hf.encode(d, add_special_tokens=False).ids) for d in docs]
    assert sorted(got) == sorted(want) and hf.token_to_id("<s>") not in stream
    assert tok.decode(list(want[0])) == docs[0]
    assert tok.eot_token not in tok.encode(f"a{eos}b")  # a literal end-of-text in a document is text
    again = pickle.loads(pickle.dumps(tok))  # as prepare's worker processes receive it
    assert again.encode(f"a{eos}b") == tok.encode(f"a{eos}b") and again.eot_token == tok.eot_token


def test_what_cannot_be_read_is_one_line_naming_the_fix(tokenizers_, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.tokenizer 'hf' needs data\.tokenizer_path"):
        validate({"data": {"tokenizer": "hf"}})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\x0a\x00")
    cases = {
        tmp_path / "none": "no such Hugging Face tokenizer.json, point data.tokenizer_path at one",
        tmp_path / "bad": "not a readable Hugging Face tokenizer.json",
        tmp_path / "sp": "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)",
    }
    for where, said in cases.items():
        with pytest.raises(DataError) as e:
            HFTokenizer.from_path(where)
        assert said in str(e.value) and "\n" not in str(e.value) and "; " not in str(e.value), str(e.value)
    # a record whose file is not the one it names
    ds = tmp_path / "ds"
    ds.mkdir()
    HFTokenizer.from_path(tokenizers_["neox"]).save(ds / TOKENIZER_FILE)
    (ds / HF_TOKENIZER_FILE).write_bytes((tokenizers_["llama"] / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="prepare the dataset again"):
        load_tokenizer(ds / TOKENIZER_FILE)


def test_a_run_on_it_exports_the_tokenizer_unchanged_and_inits_from_it(tokenizers_, corpus, tmp_path):
    """A few steps of the tiny preset on an hf dataset (one process), its checkpoint and export:
    hf/tokenizer.json is the original's bytes, transformers reads it and gives our ids, `sample`
    decodes with it, and a run of the same
    tokenizer may init_from it (another tokenizer's run may not)."""
    transformers = pytest.importorskip("transformers", reason="the dev extras install transformers")
    path, docs = corpus
    tok_dir = tokenizers_["llama"]
    data = prepare(data_config(path, tok_dir, tmp_path / "ds"))
    sets = [f"data.corpus={path}", "data.tokenizer=hf", f"data.tokenizer_path={tok_dir}",
            f"data.dataset_dir={data}", f"logging.run_dir={tmp_path / 'run'}", "schedule.max_steps=2",
            "schedule.warmup_steps=1", "batch.micro_batch_size=2", "logging.eval_interval=100",
            "logging.eval_batches=1", "logging.sample_tokens=0", "checkpoint.interval=2"]  # fmt: skip
    run = cli("train", "--preset", "tiny", *(f"--set={s}" for s in sets))
    assert run.returncode == 0, run.stderr[-3000:]
    copies = [p.read_bytes() for p in (tmp_path / "run").rglob(HF_TOKENIZER_FILE)]  # the checkpoint's
    assert copies and all(c == (tok_dir / "tokenizer.json").read_bytes() for c in copies)
    done = cli("export", str(tmp_path / "run"), "--out", str(tmp_path / "export"))
    assert done.returncode == 0, done.stderr[-3000:]
    hf_dir = tmp_path / "export" / "hf"
    # The tokenizer files as they were, but the one field the original lacks, said in one line.
    for name in ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (hf_dir / name).read_bytes() == (tok_dir / name).read_bytes(), name
    written = json.loads((hf_dir / "tokenizer_config.json").read_text())
    block = json.loads((tmp_path / "export" / "pretrain.json").read_text())["model"]["block_size"]
    assert written == {**LLAMA_CONFIG, "model_max_length": block}
    line = f"hf/: the tokenizer files of {tok_dir}; tokenizer_config.json has model_max_length {block} added"
    assert line in done.stderr
    auto = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ours = HFTokenizer.from_path(tok_dir)
    for text in (docs[1], "ROMEO: é 中"):
        assert auto(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    # A "</s>" in text is the original's special token (chat templates write it), not split as ours
    assert auto("a</s>", add_special_tokens=False)["input_ids"][-1] == 2 != ours.encode("a</s>")[-1]
    assert (auto.bos_token, auto.bos_token_id, auto.eos_token, auto.pad_token) == ("<s>", 1, "</s>", None)
    assert auto.padding_side == "right" and auto.model_max_length == block
    assert auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi</s>"
    config, gen = (json.loads((hf_dir / f).read_text()) for f in ("config.json", "generation_config.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    ids = [gen[f"{k}_token_id"] for k in ("bos", "eos", "pad")]
    assert ids == [1, 2, 2]  # no pad: eos pads a batch
    said = cli(
        "sample", str(tmp_path / "export"), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--seed", "1"
    )
    assert said.returncode == 0 and said.stdout.startswith("ROMEO:"), said.stderr[-3000:]
    # Greedy: transformers' do_sample=False on hf/, its text as transformers decodes it.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    prompt = torch.tensor([ours.encode("ROMEO: Good")])
    made = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24)
    out = made[0].tolist()
    greedy = cli("sample", str(tmp_path / "export"), "--prompt", "ROMEO: Good", "--temperature", "0",
                 "--max-new-tokens", "24")  # fmt: skip
    ended = out[-1] == 2  # </s>: transformers stops there, and so does sample
    assert greedy.stdout == auto.decode(out[:-1] if ended else out) + "\n", (greedy.stdout, out)
    assert ("ended before --max-new-tokens 24: at the end-of-text token" in greedy.stderr) == ended
    source = init_from.open_source(InitFromConfig(path=str(tmp_path / "export")))
    init_from.check_tokenizer(source, ours, ours.fingerprint(), "hf")
    other = HFTokenizer.from_path(tokenizers_["neox"])
    with pytest.raises(CheckpointError, match="trained with a hf tokenizer"):
        init_from.check_tokenizer(source, other, other.fingerprint(), "hf")
    source.export_info = None  # the hf/ directory alone: its tokenizer.json is the run's, byte for byte
    init_from.check_tokenizer(source, ours, ours.fingerprint(), "hf")
    with pytest.raises(CheckpointError, match="encodes text to other ids than the run's hf tokenizer"):
        init_from.check_tokenizer(source, other, other.fingerprint(), "hf")
    assert (tmp_path / "export" / HF_TOKENIZER_FILE).is_file() and (data / MANIFEST).is_file()


def test_the_tokenizer_files_round_trip_byte_for_byte_where_nothing_lacks(tokenizers_, tmp_path):
    """A tokenizer whose config has its own model_max_length and class: hf/ holds its files byte for
    byte, found from data.tokenizer_path (a directory or the file) or init_from's directory, and
    says so; where none of them holds the run's tokenizer.json any more, the config is built, said
    so."""
    src = tmp_path / "tok"
    shutil.copytree(tokenizers_["llama"], src)
    (src / "tokenizer_config.json").write_text(json.dumps({**LLAMA_CONFIG, "model_max_length": 4096}))
    tok = HFTokenizer.from_path(src)
    model = {"vocab_size": tok.vocab_size, "n_layer": 1, "n_embd": 16, "block_size": 32}

    def run(tokenizer_path: Path, init: Path | None = None) -> RunConfig:
        return RunConfig.model_validate({
            "model": {**model, "init_from": None if init is None else str(init)},
            "data": {"tokenizer": "hf", "tokenizer_path": str(tokenizer_path)},
        })  # fmt: skip

    cfg = run(src)
    assert tokenizer_origin(tok, cfg) == tokenizer_origin(tok, run(src / "tokenizer.json")) == src
    assert tokenizer_origin(tok, run(tmp_path / "gone", init=src)) == src
    weights = GPT(cfg.model).state_dict()
    note = write_hf(tmp_path / "hf", cfg.model, weights, "fp32", tok, src)
    assert note == f"hf/: the tokenizer files of {src}, unchanged"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes(), name
    assert tokenizer_origin(tok, run(tmp_path / "gone", init=tmp_path / "gone")) is None
    note = write_hf(tmp_path / "built", cfg.model, weights, "fp32", tok, None)
    assert note is not None and "hf/tokenizer_config.json: built" in note and "no longer holds it" in note
    assert json.loads((tmp_path / "built" / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
