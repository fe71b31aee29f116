"""model.init_from: a run starts from the weights of a local Hugging Face directory, for each class
the export writes (its layouts and the originals, built here by transformers at random init), at
ZeRO 0 and ZeRO 3 with the real DeepSpeed engine; an export round-trips exactly; and what cannot be
used is one clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.config.tree import InitFromConfig, RunConfig, validate
from pretrain.data.dataset import MANIFEST, TOKENIZER_FILE
from pretrain.data.tokenizer import CharTokenizer, TiktokenTokenizer, load_tokenizer
from pretrain.errors import CheckpointError, ConfigError
from pretrain.export import hf_tokenizer, write_hf
from pretrain.training.model import init_from
from pretrain.training.model.gpt import GPT
from tests.conftest import CORPUS, GPT2_RANKS, cli

transformers = pytest.importorskip("transformers", reason="transformers is a dev extra")

VOCAB = 72  # tiny-shakespeare's 65 characters, and room to spare
# Each class at a tiny size, configured as our GPT computes (GPT-2's own gelu_new included).
HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": (
        "GPT2",
        {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32, "activation_function": "gelu_new"},
    ),
    "neox": (
        "GPTNeoX",
        {
            "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 32, "intermediate_size": 96,
            "max_position_embeddings": 32, "use_parallel_residual": False, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
    ),
    "pythia": (  # GPT-NeoX as Pythia: parallel residual, RoPE on a quarter of each head
        "GPTNeoX",
        {
            "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 32, "intermediate_size": 96,
            "max_position_embeddings": 32, "use_parallel_residual": True, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
    "llama": (
        "Llama",
        {
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
            "intermediate_size": 64, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
        },
    ),
}  # fmt: skip


def save_hf_model(out: Path, kind: str, seed: int = 0, **config: Any) -> Any:
    """A transformers model of `kind` at random init (weights spread, biases non-zero) saved in `out`."""
    name, shape = HF_MODELS[kind]
    cfg = getattr(transformers, f"{name}Config")(vocab_size=VOCAB, **{**shape, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM" if name != "GPT2" else "GPT2LMHeadModel")(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    return model


def model_from(out: Path) -> tuple[GPT, RunConfig]:
    """Our GPT with the weights of `out`, its shape from config.json (no DeepSpeed)."""
    source = init_from.open_source(InitFromConfig(path=str(out), config=True))
    cfg = init_from.apply_config(RunConfig(), source)
    ours = GPT(cfg.model).eval()
    init_from.load_into(ours, source, cfg.model, zero3=False)
    return ours, cfg


IDS = [[(7 * i + 3 * j) % 65 for j in range(16)] for i in range(2)]  # (2, 16) ids of the char vocabulary


def hf_logits(hf: Any) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor(IDS)).logits


@pytest.fixture(scope="module")
def hf_dirs(
    tmp_path_factory: pytest.TempPathFactory, char_dataset: Path
) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each class saved by transformers, with its logits on IDS; the llama one also sharded. Each is a
    model of the char data's tokenizer: its tokenizer.json beside the weights (VOCAB is not 65)."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for kind in HF_MODELS:
        hf = save_hf_model(root / kind, kind)
        dirs[kind] = (root / kind, hf_logits(hf))
    hf.save_pretrained(root / "llama-sharded", max_shard_size="20KB")
    dirs["llama-sharded"] = (root / "llama-sharded", dirs["llama"][1])
    tokenizer = hf_tokenizer(load_tokenizer(char_dataset / TOKENIZER_FILE, None)).to_str()
    for where, _ in dirs.values():
        (where / "tokenizer.json").write_text(tokenizer)
    return dirs


def test_each_hf_class_gives_its_logits(hf_dirs):
    assert (hf_dirs["llama-sharded"][0] / init_from.INDEX).is_file()
    for kind, (where, theirs) in hf_dirs.items():
        ours, cfg = model_from(where)
        with torch.no_grad():
            logits, _ = ours(torch.tensor(IDS), torch.tensor(IDS))
        diff = (logits - theirs).abs().max().item()
        print(f"{kind}: {cfg.model.arch}/{cfg.model.position}, max |logit difference| {diff:.1e}")
        assert diff < 1e-5, kind
    assert model_from(hf_dirs["gpt2"][0])[1].model.activation == "gelu_tanh"


EXPORTS = {
    "gpt2": {},
    "gpt2-nobias-untied": {"bias": False, "tie_embeddings": False},
    "gpt2-rope": {"position": "rope"},
    "pythia": {"position": "rope", "rotary_pct": 0.25, "parallel_residual": True, "tie_embeddings": False},
    "gpt2-tanh": {"activation": "gelu_tanh"},
    "llama-gqa": {"arch": "llama", "n_kv_head": 2},
    "llama-untied": {"arch": "llama", "n_kv_head": 1, "tie_embeddings": False, "intermediate_size": 96},
    "llama-eps": {"arch": "llama", "norm_eps": 1e-6},
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_an_export_round_trips_exactly(name, tmp_path):
    tok = CharTokenizer(list("abcdefghij "))  # the Hugging Face side adds two tokens: two zero rows
    shape = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16, "vocab_size": tok.vocab_size}
    cfg = RunConfig.model_validate({"model": shape | EXPORTS[name]})
    torch.manual_seed(0)
    ours = GPT(cfg.model)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.2 * torch.randn_like(p))
    want = {k: v.clone() for k, v in ours.state_dict().items()}
    write_hf(tmp_path / "hf", cfg.model, want, "fp32", tok)
    source = init_from.open_source(InitFromConfig(path=str(tmp_path / "hf")))
    got = init_from.state_dict(source, cfg.model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    filled = init_from.apply_config(RunConfig(), source).model  # the shape from config.json
    for k in (
        "arch",
        "n_layer",
        "n_head",
        "kv_heads",
        "n_embd",
        "ffn_hidden",
        "position",
        "tie_embeddings",
        "norm_eps",
        "rotary_pct",
        "parallel_residual",
    ):
        assert getattr(filled, k) == getattr(cfg.model, k), k
    assert filled.vocab_size == tok.vocab_size + 2  # the export's rows for <|endoftext|> and <unk>


def test_the_model_section_is_checked_against_the_weights(hf_dirs):
    where = hf_dirs["llama"][0]
    source = init_from.open_source(InitFromConfig(path=str(where)))
    shape = {"arch": "llama", "n_layer": 3, "n_head": 4, "n_kv_head": 4, "n_embd": 32, "vocab_size": VOCAB}
    with pytest.raises(CheckpointError) as e:
        init_from.check(source, RunConfig.model_validate({"model": shape}).model)
    said = str(e.value)
    print(said)
    assert "model.n_layer is 3, config.json's 2" in said and "model.n_kv_head is 4, config.json's 2" in said
    assert "model.intermediate_size is 128, config.json's 64" in said
    assert "model.init_from.config=true" in said and "model.n_layer=2" in said
    # config.json and the files disagree: the tensors named
    config = json.loads((where / "config.json").read_text())
    bad = where.parent / "llama-bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(where / "model.safetensors")
    (bad / "config.json").write_text(json.dumps(config | {"intermediate_size": 80}))
    source = init_from.open_source(InitFromConfig(path=str(bad)))
    with pytest.raises(
        CheckpointError, match=r"mlp.gate_proj.weight, .*up_proj.weight make our h.0.mlp.c_fc"
    ):
        init_from.check(source, init_from.apply_config(RunConfig(), source).model)


def test_a_norm_epsilon_of_1e_6_is_taken_from_config_json_or_asked_for(tmp_path):
    """transformers' LlamaConfig (and the first Llama) default to rms_norm_eps 1e-6, ours to 1e-5."""
    hf = save_hf_model(tmp_path / "llama1", "llama", rms_norm_eps=1e-6)
    ours, cfg = model_from(tmp_path / "llama1")
    assert cfg.model.norm_eps == 1e-6
    with torch.no_grad():
        logits, _ = ours(torch.tensor(IDS), torch.tensor(IDS))
    assert (logits - hf_logits(hf)).abs().max().item() < 1e-5
    source = init_from.open_source(InitFromConfig(path=str(tmp_path / "llama1")))
    shape = {
        "arch": "llama",
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 2,
        "n_embd": 32,
        "intermediate_size": 64,
        "tie_embeddings": False,
    }
    with pytest.raises(CheckpointError) as e:
        init_from.check(source, RunConfig.model_validate({"model": shape | {"vocab_size": VOCAB}}).model)
    assert "model.norm_eps is 1e-05, config.json's 1e-06" in str(e.value) and "model.norm_eps=1e-06" in str(
        e.value
    )
    init_from.check(
        source, RunConfig.model_validate({"model": shape | {"vocab_size": VOCAB, "norm_eps": 1e-6}}).model
    )


def test_what_cannot_be_used_is_one_clear_error(hf_dirs, tmp_path):
    def said(path: Path) -> str:
        with pytest.raises(CheckpointError) as e:
            init_from.open_source(InitFromConfig(path=str(path)))
        assert "Traceback" not in str(e.value)
        return str(e.value)

    assert "no such directory" in said(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert "holds no config.json" in said(tmp_path / "empty")
    where = hf_dirs["gpt2"][0]
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    assert "describes ['BertForMaskedLM']: model.init_from reads GPT2LMHeadModel" in said(other)
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    (scaled / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPTNeoXForCausalLM"],
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "hidden_act": "relu",
            }
        )
    )
    message = said(scaled)
    assert "rope_type is 'linear': our RoPE has no scaling" in message and "hidden_act is 'relu'" in message
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((where / "config.json").read_text())
    data = (where / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors is not a readable safetensors file" in said(truncated)
    (truncated / "model.safetensors").unlink()
    (truncated / "pytorch_model.bin").write_bytes(b"pickle")
    assert "pytorch_model.bin is a pickle, which is never read" in said(truncated)


def run_tokenizer(data: Path) -> tuple[Any, str]:
    """The char data's tokenizer and its fingerprint, as setup reads them."""
    manifest = json.loads((data / MANIFEST).read_text())
    return load_tokenizer(data / TOKENIZER_FILE, None), manifest["tokenizer"]["fingerprint"]


def test_a_vocabulary_of_another_size_and_no_tokenizer_json_is_refused(char_dataset, tmp_path):
    """GPT-2's 50257 tokens saved by save_pretrained (no tokenizer.json), on the char data: its ids
    0..64 would be GPT-2's. Refused in one line naming both vocabularies and the fix; with its own
    tokenizer.json beside the weights, that is what is checked; a vocabulary of the same size passes."""
    tok, fingerprint = run_tokenizer(char_dataset)
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 8, "n_positions": 16}
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).save_pretrained(tmp_path / "gpt2")

    def run(where: Path) -> RunConfig:
        spec = {"path": str(where), "config": True}
        cfg = RunConfig.model_validate({"data": {"tokenizer": "char"}, "model": {"init_from": spec}})
        return init_from.open_checked(cfg, tok, fingerprint)[0]

    with pytest.raises(CheckpointError) as e:
        run(tmp_path / "gpt2")
    said = str(e.value)
    print(said)
    assert "\n" not in said and "its vocabulary has 50257 tokens, the run's char tokenizer 65" in said
    assert "ids 0..64 would be fed to it as its own" in said and "put the model's tokenizer.json" in said
    (tmp_path / "gpt2" / "tokenizer.json").write_text(hf_tokenizer(tok).to_str())
    assert run(tmp_path / "gpt2").model.vocab_size == 50257
    config = transformers.GPT2Config(vocab_size=tok.vocab_size, **shape)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "same")
    assert run(tmp_path / "same").model.vocab_size == 65


def test_the_weight_files_are_the_directorys_own_and_one_set(hf_dirs, tmp_path):
    """An index entry that leaves the directory (to a sound safetensors file) is refused by name,
    never opened; an index beside a model.safetensors of other weights is refused, naming both; a
    link that loops or leads nowhere is named as such."""

    def said(path: Path) -> str:
        with pytest.raises(CheckpointError) as e:
            init_from.open_source(InitFromConfig(path=str(path)))
        assert "\n" not in str(e.value)
        return str(e.value)

    sharded, whole = hf_dirs["llama-sharded"][0], hf_dirs["llama"][0] / init_from.WEIGHTS
    (tmp_path / "outside").mkdir()
    shutil.copy(whole, tmp_path / "outside" / init_from.WEIGHTS)  # holds every tensor: it would load
    escape = tmp_path / "models" / "escape"
    shutil.copytree(sharded, escape)
    index = json.loads((escape / init_from.INDEX).read_text())
    name = next(iter(index["weight_map"]))
    for entry in ("../../outside/model.safetensors", str(tmp_path / "outside" / init_from.WEIGHTS)):
        index["weight_map"][name] = entry
        (escape / init_from.INDEX).write_text(json.dumps(index))
        assert f"maps {name} to {entry!r}, outside the directory" in said(escape)
    both = tmp_path / "both"
    shutil.copytree(sharded, both)
    save_hf_model(tmp_path / "other", "llama", seed=1)
    shutil.copy(tmp_path / "other" / init_from.WEIGHTS, both)
    message = said(both)
    assert "holds both model.safetensors and model.safetensors.index.json (which names 6 other" in message
    assert "model-00001-of-00006.safetensors" in message and "remove the one that is not" in message
    loop = tmp_path / "loop"
    loop.mkdir()
    shutil.copy(sharded / "config.json", loop)
    (loop / init_from.WEIGHTS).symlink_to(init_from.WEIGHTS)
    assert "model.safetensors is a symbolic link that loops (model.safetensors -> model.safetensors)" in said(
        loop
    )
    (loop / init_from.WEIGHTS).unlink()
    (loop / init_from.WEIGHTS).symlink_to("gone.safetensors")
    assert "model.safetensors is a symbolic link to gone.safetensors, which is not there" in said(loop)
    (loop / "config.json").unlink()
    (loop / "config.json").symlink_to("config.json")
    assert "config.json is a symbolic link that loops (config.json -> config.json)" in said(loop)
    (tmp_path / "dir-loop").symlink_to("dir-loop")
    assert "dir-loop is a symbolic link that loops (dir-loop -> dir-loop)" in said(tmp_path / "dir-loop")
    cycle = tmp_path / "cycle"
    shutil.copytree(sharded, cycle)
    first, second = (cycle / f"model-0000{i}-of-00006.safetensors" for i in (1, 2))
    first.unlink()
    second.unlink()
    first.symlink_to(second.name)
    second.symlink_to(first.name)
    assert (
        f"names {first.name}, and {first.name} is a symbolic link that loops ({first.name} -> {second.name} "
        f"-> {first.name})" in said(cycle)
    )


def test_a_nan_or_inf_in_the_weights_is_named_when_they_are_read(hf_dirs, tmp_path):
    """A NaN (or inf) in a tensor is found as it is read, named with its file; a tensor-parallel rank
    reads only its slices, so the rank that finds it may be the only one: setup gathers every rank's
    finding before DeepSpeed starts (tested on 2 ranks below)."""
    where = tmp_path / "nan"
    shutil.copytree(hf_dirs["llama"][0], where)
    weights = load_file(str(where / init_from.WEIGHTS))
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    weights["model.layers.0.mlp.down_proj.weight"][0, 40] = float("inf")  # column 40: tensor rank 1's
    save_file(weights, str(where / init_from.WEIGHTS), metadata={"format": "pt"})
    source = init_from.open_source(InitFromConfig(path=str(where), config=True))
    m = init_from.apply_config(RunConfig(), source).model
    with pytest.raises(CheckpointError) as e:
        init_from.state_dict(source, m)
    assert str(e.value) == (
        f"model.init_from {where}: model.safetensors holds inf in model.layers.0.mlp.down_proj.weight: weights "
        "that train to a non-finite loss. Save the model again from sound weights, or init_from another model"
    )
    weights["model.layers.0.mlp.down_proj.weight"][0, 40] = 0.0
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    weights["model.layers.1.mlp.up_proj.weight"][4, 5] = float("nan")
    save_file(weights, str(where / init_from.WEIGHTS), metadata={"format": "pt"})
    source = init_from.open_source(InitFromConfig(path=str(where), config=True))
    with pytest.raises(CheckpointError, match=r"holds NaN and inf in model\.layers\.1\.mlp\.up_proj\.weight"):
        init_from.state_dict(source, m)
    weights["model.layers.1.mlp.up_proj.weight"][3:5, 5] = 0.0
    weights["model.layers.0.mlp.down_proj.weight"][0, 40] = float("inf")
    save_file(weights, str(where / init_from.WEIGHTS), metadata={"format": "pt"})
    found = []
    for rank in range(2):
        source = init_from.open_source(InitFromConfig(path=str(where), config=True))
        params = {k: torch.empty_like(v) for k, v in GPT(m).state_dict().items()}
        init_from.load_shares(params, source, m, (2, rank))
        found.append(source.non_finite)
    assert found[0] is None and "holds inf in model.layers.0.mlp.down_proj.weight" in str(found[1])


# A short run of the tiny preset on the char data, from init_from (`train_args`).
RUN = ["batch.micro_batch_size=2", "schedule.warmup_steps=1", "logging.log_interval=1",
       "logging.eval_interval=100", "logging.eval_batches=1", "logging.sample_tokens=0",
       "checkpoint.interval=2"]  # fmt: skip


def train_args(data: Path, where: Path, run_dir: Path, *sets: str) -> list[str]:
    return ["train", "--preset", "tiny", CORPUS, f"--set=data.dataset_dir={data}",
            f"--set=model.init_from.path={where}", f"--set=logging.run_dir={run_dir}",
            *(f"--set={s}" for s in [*RUN, *sets])]  # fmt: skip


def test_a_resume_does_not_need_the_init_from_directory(hf_dirs, char_dataset, tmp_path):
    """A run started from init_from resumes once the directory is gone (a resume takes the
    checkpoint's weights); without a checkpoint to resume, it starts from init_from, and one line
    says the directory is gone."""
    where = tmp_path / "gpt2"
    shutil.copytree(hf_dirs["gpt2"][0], where)
    model = [
        "n_layer=2",
        "n_head=2",
        "n_embd=32",
        "block_size=32",
        f"vocab_size={VOCAB}",
        "activation=gelu_tanh",
    ]
    sets = [f"model.{s}" for s in model]
    first = cli(*train_args(char_dataset, where, tmp_path / "run", *sets, "schedule.max_steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(where)
    again = cli(*train_args(char_dataset, where, tmp_path / "run", *sets, "schedule.max_steps=3"), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert f"model.init_from {where}: not loaded, the checkpoint's weights win on a resume" in out
    assert "step      3/3" in out
    fresh = cli(*train_args(char_dataset, where, tmp_path / "fresh", *sets), "--resume", "auto")
    assert fresh.returncode == 2 and "Traceback" not in fresh.stderr, fresh.stderr[-3000:]
    assert f"error: model.init_from {where}: no such directory" in fresh.stderr
    # with the shape taken from config.json (init_from.config): the run's recorded shape stands in for it
    shutil.copytree(hf_dirs["gpt2"][0], where)
    shaped = ["model.init_from.config=true"]
    first = cli(*train_args(char_dataset, where, tmp_path / "shaped", *shaped, "schedule.max_steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(where)
    again = cli(
        *train_args(char_dataset, where, tmp_path / "shaped", *shaped, "schedule.max_steps=3"), "--resume"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step      3/3" in again.stdout + again.stderr


@pytest.mark.distributed
def test_an_inf_only_one_tensor_rank_reads_stops_every_rank_at_start(hf_dirs, char_dataset, tmp_path):
    """2 ranks under tensor parallelism: only rank 1 reads the inf (its columns of a row-parallel
    weight); both stop before DeepSpeed starts, with one line naming the file and the tensor (it was
    step 1's "non-finite loss", naming neither)."""
    where = tmp_path / "inf"
    shutil.copytree(hf_dirs["llama"][0], where)
    weights = load_file(str(where / init_from.WEIGHTS))
    weights["model.layers.0.mlp.down_proj.weight"][0, 40] = float("inf")
    save_file(weights, str(where / init_from.WEIGHTS), metadata={"format": "pt"})
    sets = ["model.init_from.config=true", "zero.stage=1", "parallel.tensor=2", "schedule.max_steps=2"]
    done = cli(*train_args(char_dataset, where, tmp_path / "run", *sets), "--nproc-per-node", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = (
        f"error: model.init_from {where}: model.safetensors holds inf in model.layers.0.mlp.down_proj.weight: "
        "weights that train to a non-finite loss. Save the model again from sound weights, or init_from "
        "another model\n"
    )
    assert done.stderr.count(line) == 1 and "non-finite loss 1 steps" not in done.stdout + done.stderr


def test_an_exports_tokenizer_must_be_the_runs(tmp_path):
    tok = CharTokenizer(list("abcdefghij "))
    cfg = RunConfig.model_validate({"model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 11}})
    (tmp_path / "export").mkdir()
    write_hf(tmp_path / "export" / "hf", cfg.model, GPT(cfg.model).state_dict(), "fp32", tok)
    info = {
        "model": {},
        "source": "x",
        "tokenizer_fingerprint": tok.fingerprint(),
        "config": {"data": {"tokenizer": "char"}},
    }
    (tmp_path / "export" / "pretrain.json").write_text(json.dumps(info))
    source = init_from.open_source(InitFromConfig(path=str(tmp_path / "export")))  # an export: its hf/
    assert source.dir == tmp_path / "export" / "hf"
    init_from.check_tokenizer(source, tok, tok.fingerprint(), "char")
    gpt2 = TiktokenTokenizer(GPT2_RANKS)
    with pytest.raises(
        CheckpointError, match=r"trained with a char tokenizer .* the run's data uses a gpt2 tokenizer"
    ):
        init_from.check_tokenizer(source, gpt2, gpt2.fingerprint(), "gpt2")
    source.export_info = None  # any directory: its vocabulary must hold the tokenizer's ids
    with pytest.raises(CheckpointError, match="its vocabulary has 13 tokens, the run's gpt2 tokenizer 50257"):
        init_from.check_tokenizer(source, gpt2, gpt2.fingerprint(), "gpt2")
    # and where it has a tokenizer.json of its own, that tokenizer must give the run's ids
    init_from.check_tokenizer(source, tok, tok.fingerprint(), "char")
    other = CharTokenizer(list("ABabcdefghij "))  # two more characters: the same ones get other ids
    with pytest.raises(
        CheckpointError, match=r"its tokenizer.json encodes text to other ids than the run's char"
    ):
        init_from.check_tokenizer(source, other, other.fingerprint(), "char")


def test_init_from_config_forms_and_model_parallel_layouts():
    m = validate({"model": {"init_from": "/x"}}).model
    assert m.init_from == InitFromConfig(path="/x", config=False)
    assert validate({"model": {"init_from": {"path": "/x", "config": True}}}).model.init_from.config
    with pytest.raises(ConfigError, match=r"init_from\.confg: unknown field"):
        validate({"model": {"init_from": {"path": "/x", "confg": True}}})
    for layout in ({"pipeline": 2}, {"tensor": 2}, {"tensor": 2, "pipeline": 2}):
        cfg = validate(
            {"model": {"init_from": "/x", "n_layer": 2}, "parallel": layout, "zero": {"stage": 1}},
            world_size=4,
        )
        assert cfg.parallel.model_parallel == layout.get("tensor", 1) * layout.get("pipeline", 1)


def test_config_true_fills_the_model_section_when_the_config_is_built(hf_dirs, capsys):
    """`init_from.config: true` is applied by build(): `pretrain config` shows the shape the run will
    have, a global batch in tokens is divided by config.json's block_size (32, the preset's is 256),
    the parallel rules see its heads, and an unusable directory is listed with the other problems."""
    from pretrain.cli import main
    from pretrain.config.presets import build

    where = hf_dirs["llama"][0]
    sets = [f"model.init_from.path={where}", "model.init_from.config=true"]
    cfg = build(
        "tiny", overrides=[*sets, "batch.global_batch_tokens=2048", "batch.micro_batch_size=8"], world_size=2
    )
    m = cfg.model
    assert (m.arch, m.n_layer, m.n_head, m.n_kv_head, m.n_embd, m.block_size) == ("llama", 2, 4, 2, 32, 32)
    assert cfg.batch.gradient_accumulation_steps == 4 and cfg.batch.sequences == 64  # 2048 / 32
    assert main(["config", *(f"--set={s}" for s in sets)]) == 0
    shown = capsys.readouterr().out
    assert "  arch: llama\n" in shown and "  n_kv_head: 2\n" in shown and "  block_size: 32\n" in shown
    with pytest.raises(ConfigError) as e:
        build("tiny", overrides=[*sets, "parallel.tensor=8"], world_size=8)
    assert "parallel.tensor (8) must divide model.n_head (4)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build(
            "tiny",
            overrides=[
                f"model.init_from.path={where}-gone",
                "model.init_from.config=true",
                "model.n_layer=0",
            ],
        )
    assert e.value.problems[0].startswith(f"model.init_from {where}-gone: no such directory")
    assert any(p.startswith("model.n_layer:") for p in e.value.problems[1:])


def test_the_gpt_neox_layout_options_are_checked():
    """rotary_pct and parallel_residual (Pythia's GPT-NeoX): RoPE on whole pairs of a head's first
    dimensions, in the layout the GPTNeoX export writes; every misuse named with its fix."""
    m = validate({"model": {"position": "rope", "rotary_pct": 0.25, "parallel_residual": True}}).model
    assert m.head_size == 64 and m.rotary_dims == 16
    for model, needle in [
        ({"rotary_pct": 0.5}, "rotary_pct is the share of a head that RoPE rotates: set model.position=rope"),
        ({"parallel_residual": True}, "parallel_residual is the GPT-NeoX (Pythia) layout: arch gpt2 with"),
        ({"arch": "llama", "parallel_residual": True}, "(got arch llama, position rope)"),
        ({"arch": "llama", "rotary_pct": 0.5}, "arch llama rotates the whole head"),
        (
            {"position": "rope", "n_embd": 40, "rotary_pct": 0.25},
            "head size (20) gives 5, which must be even",
        ),
        ({"position": "rope", "rotary_pct": 0}, "rotary_pct: Input should be greater than 0"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate({"model": model})
        assert any(needle in p for p in e.value.problems), (model, e.value.problems)


@pytest.mark.parametrize("kind", ["gpt2", "neox", "pythia", "llama"])
def test_the_tensor_ranks_slices_make_the_whole_model(hf_dirs, kind):
    """Each tensor rank reads only its slices (init_from.tensor_share, into a model of NaNs): put back
    together as the export does (export.merge_tensor_parallel, the inverse of AutoTP's split), the
    two ranks' parameters are the whole model's, bit for bit."""
    from pretrain.export import merge_tensor_parallel

    source = init_from.open_source(InitFromConfig(path=str(hf_dirs[kind][0]), config=True))
    m = init_from.apply_config(RunConfig(), source).model
    whole = init_from.state_dict(source, m)
    shards: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        params = {k: torch.full_like(v, float("nan")) for k, v in whole.items()}
        init_from.load_shares(params, source, m, (2, rank))
        for k, v in params.items():
            rows, cols = init_from.tensor_share(k, m, tuple(v.shape), (2, rank))
            kept = torch.cat([v[a:b] for a, b in rows]) if rows else v[:, cols[0] : cols[1]]
            assert not kept.isnan().any(), k  # everything the rank keeps was read
            shards.setdefault(k, []).append(kept)
    split = [k for k, v in shards.items() if v[0].shape != whole[k].shape]
    assert len(split) == 4 * m.n_layer + (2 * m.n_layer if m.bias else 0)  # q/k/v, fc; out projections
    for k, v in shards.items():
        assert torch.equal(merge_tensor_parallel(k, v, m), whole[k]), k


@pytest.mark.distributed
def test_first_step_logits_equal_hfs_at_zero_0_and_3(hf_dirs, char_dataset, tmp_path):
    """The real setup and engine: 1 rank at ZeRO 0, 2 ranks at ZeRO 3 (zero.Init, then one gathered
    parameter at a time), each class; a resume ignores init_from (the checkpoint wins)."""

    def jobs(stage: int) -> list[dict[str, Any]]:
        return [
            {
                "name": kind,
                "run": f"{kind}-z{stage}",
                "overrides": [
                    f"model.init_from.path={hf_dirs[kind][0]}",
                    "model.init_from.config=true",
                    f"zero.stage={stage}",
                ],
            }
            for kind in ("gpt2", "neox", "pythia", "llama-sharded" if stage == 3 else "llama")
        ]

    resume = [f"model.init_from.path={hf_dirs['llama'][0]}", "model.init_from.config=true", "zero.stage=0"]
    one = torchrun_logits(1, tmp_path / "z0", char_dataset, [
        *jobs(0),
        {"name": "first", "run": "resumed", "overrides": resume, "train": True},
        {"name": "again", "run": "resumed", "overrides": [*resume, "schedule.max_steps=3"], "train": True,
         "resume": "auto"},
    ])  # fmt: skip
    assert "not loaded, the checkpoint's weights win on a resume" in one["_stdout"]
    two = torchrun_logits(2, tmp_path / "z3", char_dataset, jobs(3))
    for stage, logits in ((0, one), (3, two)):
        for kind in HF_MODELS:
            diff = logits[kind if kind != "llama" or stage == 0 else "llama-sharded"] - hf_dirs[kind][1]
            print(f"ZeRO-{stage} {kind}: max |logit difference| {diff.abs().max().item():.1e}")
            assert diff.abs().max() < 1e-5


@pytest.mark.distributed
def test_first_step_logits_equal_hfs_under_tensor_and_pipeline_parallelism(hf_dirs, char_dataset, tmp_path):
    """2 ranks at ZeRO-1, the real setup and engine: tensor parallelism (AutoTP; each rank reads its
    slices: Llama with grouped-query attention, a rank holding 2 query heads and 1 key/value head;
    GPT-2's transposed Conv1D weights and split biases; NeoX's per-head q, k, v) and a pipeline of
    2 stages (each reads its layers: GPT-2's tied head on the last stage from the embedding, a
    sharded Llama's own head). The logits are Hugging Face's, and the optimizer's fp32 master copy
    is the loaded weights (they were loaded before deepspeed.initialize)."""
    jobs = [
        {
            "name": f"{kind}-{layout}",
            "run": f"{kind}-{layout}",
            "overrides": [
                f"model.init_from.path={hf_dirs[kind][0]}",
                "model.init_from.config=true",
                "zero.stage=1",
                f"parallel.{layout}=2",
            ],
        }
        for kind, layout in (
            ("llama", "tensor"), ("gpt2", "tensor"), ("neox", "tensor"), ("pythia", "tensor"),
            ("gpt2", "pipeline"), ("pythia", "pipeline"), ("llama-sharded", "pipeline"),
        )
    ]  # fmt: skip
    got = torchrun_logits(2, tmp_path / "mp", char_dataset, jobs, port=29597)
    for job in jobs:
        name, kind = job["name"], job["name"].rsplit("-", 1)[0]
        diff = (got[name] - hf_dirs[kind][1]).abs().max().item()
        print(f"{name}: max |logit difference| {diff:.1e}, master copy {got[name + '.master'].item():.1e}")
        assert diff < 1e-5, name
        assert got[name + ".master"].item() == 0.0, name


@pytest.mark.distributed
def test_first_step_logits_equal_hfs_under_tensor_x_pipeline(hf_dirs, char_dataset, tmp_path):
    """4 ranks, tensor 2 x pipeline 2 at ZeRO-1: each rank reads its stage's layers, and of those its
    tensor slices (AutoTP applied inside the stage); the last stage's logits are Hugging Face's."""
    jobs = [
        {
            "name": kind,
            "run": kind,
            "overrides": [
                f"model.init_from.path={hf_dirs[kind][0]}",
                "model.init_from.config=true",
                "zero.stage=1",
                "parallel.tensor=2",
                "parallel.pipeline=2",
            ],
        }
        for kind in ("llama", "gpt2")
    ]
    got = torchrun_logits(4, tmp_path / "tp2pp2", char_dataset, jobs, port=29598)
    for kind in ("llama", "gpt2"):
        diff = (got[kind] - hf_dirs[kind][1]).abs().max().item()
        print(f"{kind} tensor 2 x pipeline 2: max |logit difference| {diff:.1e}")
        assert diff < 1e-5, kind
        assert got[kind + ".master"].item() == 0.0, kind


def torchrun_logits(
    nproc: int, out: Path, data: Path, jobs: list[dict[str, Any]], port: int = 29596
) -> dict[str, Any]:
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    out.mkdir()
    (out / "jobs.json").write_text(json.dumps(jobs))
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                "--master_port", str(port)] if nproc > 1 else []  # fmt: skip
    cmd = [sys.executable, *launcher, str(ROOT / "tests" / "init_from_worker.py"), str(data), str(out),
           str(out / "jobs.json"), json.dumps(IDS)]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return {**load_file(str(out / "jobs.logits.safetensors")), "_stdout": proc.stdout + proc.stderr}
