"""`sample`, `plot`, `render` and `export` fed what users fed them: absurd sizes and seeds, damaged and
mismatched checkpoints and exports, malformed metrics, outputs at `/`, a directory or another format.
Each is one message naming the problem and the fix (or a bounded, streamed result), never a traceback,
and nothing already written is lost. On one real tiny training run (gpt2 with RoPE and tied
embeddings: GPT-NeoX in Hugging Face), exported through the real path."""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.training.checkpoint import store as checkpoint
from tests.conftest import BIN, GPT2_RANKS, ROOT, subprocess_env
from tests.test_safety import one_error, train_args, tree

STEP = "step_00000002"


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the CLI subprocesses of the suite get (OMP_NUM_THREADS=1): on a busy CI
    machine two spinning threads make the tiny model's ops ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def main(*argv: str) -> subprocess.CompletedProcess[str]:
    """`pretrain ARGV` in this process (torch and DeepSpeed load once for the whole file)."""
    from pretrain.cli import main as pretrain

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = pretrain(list(argv))
        except SystemExit as e:  # argparse's own errors
            rc = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(list(argv), rc, out.getvalue(), err.getvalue())


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def rope_run(char_dataset, tmp_path_factory) -> Path:
    """Two steps of the tiny model with rotary positions and (the default) tied embeddings."""
    run_dir = tmp_path_factory.mktemp("fuzz_commands") / "run"
    done = subprocess.run(
        [str(BIN / "pretrain"), *train_args(char_dataset, run_dir, 2), "--set", "model.position=rope"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def rope_export(rope_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz_commands_export") / "export"
    assert "GPTNeoXForCausalLM" in ok(main("export", str(rope_run), "--out", str(out)))
    return out


def copy_run(run: Path, to: Path) -> tuple[Path, Path]:
    shutil.copytree(run, to)
    return to, to / "checkpoints" / STEP


def edit_meta(ckpt: Path, edit) -> None:
    """Change a checkpoint's meta and seal it again: a meta another version wrote, consistent in
    itself, that this version reads."""
    path = ckpt / checkpoint.META
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(checkpoint.seal(meta)))


# ---------------------------------------------------------------------------------------------
# sample


def test_sample_refuses_unbounded_sizes_and_out_of_range_seeds(rope_run):
    for argv, needles in [
        (["--max-new-tokens", "100000000000"], ["100,000,000,000 tokens", "(10,000,000)", "ask for fewer"]),
        (["--num-samples", "100000000"], ["--num-samples 100000000 x --max-new-tokens 200", "ask for fewer"]),
    ]:
        one_error(main("sample", str(rope_run), *argv), *needles)
    for seed in ("99999999999999999999999", "18446744073709551616", "-1"):
        done = main("sample", str(rope_run), "--seed", seed)
        assert done.returncode == 2 and "argument --seed" in done.stderr and "Traceback" not in done.stderr
    assert "from 0 to 2**64 - 1" in main("sample", str(rope_run), "--seed", "9" * 30).stderr
    ok(main("sample", str(rope_run), "--seed", str(2**64 - 1), "--max-new-tokens", "3"))


def test_many_samples_are_made_in_batches_each_its_own_seed(rope_run):
    """Five thousand samples: made in batches of bounded memory (`--num-samples 100000000` allocated
    51 GB at once); sample i is the sample of --seed SEED+i alone."""
    from pretrain.export import load_model, tokenizer_for
    from pretrain.generate import generate, sample_batch_size

    model, cfg, where = load_model(rope_run)
    assert sample_batch_size(cfg.model, 5000, 1) < 5000
    out = ok(main("sample", str(rope_run), "--num-samples", "5000", "--max-new-tokens", "1", "--seed", "5"))
    assert out.count("--- sample ") == 5000 and "--- sample 5000 ---" in out
    tok = tokenizer_for(where, cfg)
    three = generate(model, tok, "ROMEO:", 30, 0.9, 20, seed=5, num_samples=3)
    assert three[2] == generate(model, tok, "ROMEO:", 30, 0.9, 20, seed=7)[0]
    assert len(set(three)) == 3


def test_a_long_sample_prints_as_it_goes_and_a_closed_pipe_ends_it_quietly(rope_run):
    """A million tokens: text comes long before the end (the context stays block_size, the memory
    bounded); the reader closing the pipe (`| head -c 64`) ends it with exit 0 and no second error."""
    argv = [str(BIN / "pretrain"), "sample", str(rope_run), "--max-new-tokens", "1000000"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        first = b""
        deadline = time.monotonic() + 120
        while len(first) < 64 and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1)[0]:
                first += os.read(proc.stdout.fileno(), 64)
        assert len(first) >= 64, "nothing printed while sampling"
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and b"Traceback" not in err and b"Exception ignored" not in err, err[-2000:]


def test_sample_draws_only_ids_the_tokenizer_has(rope_run):
    """A model whose vocabulary is padded past its tokenizer's never samples an id that cannot be
    decoded; a tokenizer larger than the model's vocabulary is refused (it would index past it)."""
    from pretrain.config.tree import RunConfig
    from pretrain.data.tokenizer import CharTokenizer
    from pretrain.errors import DataError
    from pretrain.generate import generate
    from pretrain.training.model.gpt import GPT

    tok = CharTokenizer(list("abcdefgh"))
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}
    padded = GPT(RunConfig.model_validate({"model": {**shape, "vocab_size": 64}}).model).eval()
    (text,) = generate(padded, tok, "abc", 200, 1.0, None, seed=0)
    assert len(text) == 203 and set(text) <= set("abcdefgh")
    small = GPT(RunConfig.model_validate({"model": {**shape, "vocab_size": 4}}).model).eval()
    with pytest.raises(DataError, match="the tokenizer has 8 tokens, the model 4"):
        generate(small, tok, "abc", 5, 1.0, None, seed=0)


def test_streamed_text_is_the_decoded_text():
    """Token by token, a byte-level BPE's characters split over tokens are held back until whole:
    the streamed text is `decode` of all the ids, U+FFFD where `decode` has it."""
    import random

    from pretrain.data.tokenizer import TiktokenTokenizer
    from pretrain.generate import _Decoder

    tok = TiktokenTokenizer(GPT2_RANKS)
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(40)] + tok.encode(
            "日本"
        )  # 日 and 本: two tokens each
        decoder = _Decoder(tok)
        assert "".join(decoder([i]) for i in ids) + decoder.flush() == tok.decode(ids)


def test_sample_hostile_temperatures_devices_and_prompts(rope_run):
    for t in ("1e-300", "5e-324", "1e999"):  # greedy, greedy, uniform: never NaN
        assert len(ok(main("sample", str(rope_run), "--temperature", t, "--max-new-tokens", "8"))) >= 9
    ok(main("sample", str(rope_run), "--top-k", "9" * 40, "--max-new-tokens", "4"))
    for device in ("meta", "lazy", "hpu", "cpu:-1", "cuda:99"):
        one_error(main("sample", str(rope_run), "--device", device), f"--device {device!r}: not usable here")
    one_error(main("sample", str(rope_run), "--prompt", "é"), "--prompt: character 'é'")
    one_error(main("sample", str(rope_run), "--prompt", "a", "--prompt", "é"), "--prompt 2: character 'é'")


def test_sample_names_a_prompt_file_line_the_tokenizer_refuses(rope_run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("To be\n\nor not é\n", encoding="utf-8")
    one_error(
        main("sample", str(rope_run), "--prompt-file", str(prompts)),
        f"--prompt-file {prompts}, line 3: character 'é'",
    )


# ---------------------------------------------------------------------------------------------
# checkpoint and export readers


def test_damaged_checkpoints_are_one_message_naming_the_file(rope_run, tmp_path):
    _, ckpt = copy_run(rope_run, tmp_path / "run")
    model_file = ckpt / "mp_rank_00_model_states.pt"
    data = bytearray(model_file.read_bytes())
    data[-30] ^= 0xFF  # the zip's directory: torch cannot open it
    model_file.write_bytes(bytes(data))
    for argv in (["sample", str(ckpt)], ["export", str(ckpt), "--out", str(tmp_path / "x")]):
        one_error(
            main(*argv, "--no-checksums"), f"{model_file}: cannot read the weights", "without --no-checksums"
        )
        one_error(main(*argv), "invalid checkpoint", "blake3 differs")
    assert not (tmp_path / "x").exists()

    # A config this version does not accept (a newer version's field), sealed as that version would.
    _, ckpt = copy_run(rope_run, tmp_path / "newer")
    edit_meta(ckpt, lambda meta: meta["config"]["data"].update(new_field=1))
    for argv in (["sample", str(ckpt)], ["export", str(ckpt), "--out", str(tmp_path / "x")]):
        one_error(
            main(*argv),
            f"{ckpt / checkpoint.META}: config.data.new_field",
            "the version its 'versions' names",
        )
    # A config.model that is no model: refused by the reader's verification.
    edit_meta(ckpt, lambda meta: meta["config"]["model"].update(n_layer=-3))
    one_error(main("sample", str(ckpt)), "config.model.n_layer")
    # A config that does not match the weights.
    _, ckpt = copy_run(rope_run, tmp_path / "other")
    edit_meta(ckpt, lambda meta: meta["config"]["model"].update(n_layer=3))
    for argv in (["sample", str(ckpt)], ["export", str(ckpt), "--out", str(tmp_path / "x")]):
        one_error(
            main(*argv),
            f"{ckpt}: the weights do not match the model config in pretrain_meta.json",
            "lacks h.2.",
        )
    assert not (tmp_path / "x").exists()


def test_damaged_or_mismatched_exports_are_one_message_naming_the_file(rope_export, rope_run, tmp_path):
    def damaged(name: str, damage) -> Path:
        out = tmp_path / name
        shutil.copytree(rope_export, out)
        damage(out)
        return out

    truncated = damaged("truncated", lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:5000]))  # fmt: skip
    one_error(main("sample", str(truncated)), f"{truncated / 'model.safetensors'}: not a readable safetensors file",
              "export it again")  # fmt: skip

    def smaller(d: Path) -> None:
        info = json.loads((d / "pretrain.json").read_text())
        info["config"]["model"].update(n_embd=64)
        (d / "pretrain.json").write_text(json.dumps(info))

    other = damaged("other", smaller)
    one_error(
        main("sample", str(other)),
        "do not match the model config in pretrain.json",
        "[384, 128]",
        "export it again",
    )

    def nan(d: Path) -> None:
        sd = load_file(str(d / "model.safetensors"))
        sd["ln_f.weight"][0] = float("nan")
        save_file(sd, str(d / "model.safetensors"))

    one_error(main("sample", str(damaged("nan", nan))), "ln_f.weight holds NaN or inf", "export it again")
    # Exporting again over the damaged export mends it.
    ok(main("export", str(rope_run), "--out", str(truncated)))
    ok(main("sample", str(truncated), "--max-new-tokens", "4"))


def test_gpt2_rope_tied_exports_to_gpt_neox_through_the_real_path(rope_run, rope_export):
    """Tied wte/lm_head share memory in the real consolidated weights (safetensors refuses that):
    the head is stored once, as GPT-NeoX's embed_in, and tied back by tie_word_embeddings."""
    hf_weights = load_file(str(rope_export / "hf" / "model.safetensors"))
    assert "embed_out.weight" not in hf_weights and "gpt_neox.embed_in.weight" in hf_weights
    config = json.loads((rope_export / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"] and config["tie_word_embeddings"] is True
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "3"]
    assert ok(main("sample", str(rope_export), *args)) == ok(main("sample", str(rope_run), *args))

    transformers = pytest.importorskip("transformers", reason="transformers is a dev extra")
    from pretrain.export import load_model

    ours, _, _ = load_model(rope_export)
    hf = transformers.AutoModelForCausalLM.from_pretrained(rope_export / "hf").eval()
    idx = torch.randint(
        0, ours.cfg.vocab_size, (2, ours.cfg.block_size), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        theirs, logits = hf(idx).logits, ours(idx, idx)[0]
    # the export's extra rows (the HF char tokenizer's <|endoftext|> and <unk>) are zero: logit 0
    vocab = logits.size(-1)
    assert (logits - theirs[..., :vocab]).abs().max().item() < 1e-4
    assert not theirs[..., vocab:].any()


def test_export_to_the_current_directory_and_through_a_symlink_loop(rope_run, tmp_path, monkeypatch):
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    for out in ("", "."):
        ok(main("export", str(rope_run), "--out", out, "--no-hf"))
        assert (tmp_path / "empty" / "model.safetensors").is_file()
        monkeypatch.chdir(tmp_path / "empty")  # the directory was replaced whole: enter the new one
    one_error(
        main("export", str(rope_run), "--out", str(rope_run / "config.yaml" / "x")),
        "is a file, not a directory",
    )
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    one_error(main("export", str(rope_run), "--out", str(tmp_path / "a")), "--out", "cannot be resolved")


# ---------------------------------------------------------------------------------------------
# plot


def test_plot_skips_malformed_rows_and_says_how_many(rope_run, tmp_path):
    run, _ = copy_run(rope_run, tmp_path / "run")
    with (run / "metrics.csv").open("ab") as f:
        f.write(
            b"3,abc,0.1\n\xff\xfe\x00binary\x00\n" + b"4," * 40 + b"\n5,nan,inf\n" + b"9" * 100_000 + b"\n"
        )
    with (run / "starts.csv").open("a") as f:
        f.write("x,y,z\n")
    done = main("plot", str(run))
    assert ok(done) == f"wrote {run / 'metrics.png'}\n"
    assert f"{run / 'metrics.csv'}: skipped 4 malformed rows (lines " in done.stderr
    assert f"{run / 'starts.csv'}: skipped 1 malformed row (line 3)" in done.stderr
    assert (run / "metrics.png").read_bytes().startswith(b"\x89PNG")

    (run / "metrics.csv").write_bytes(os.urandom(4000))
    one_error(main("plot", str(run)), "not a run's metrics.csv")
    (run / "metrics.csv").write_bytes(b"")
    one_error(main("plot", str(run)), "not a run's metrics.csv")


def test_plot_writes_exactly_the_path_given_and_never_over_a_directory_or_a_foreign_file(rope_run, tmp_path):
    run, _ = copy_run(rope_run, tmp_path / "run")
    for name in ("plot", "plot.png", "new/dir/plot.v2"):
        assert ok(main("plot", str(run), "--out", str(tmp_path / name))) == f"wrote {tmp_path / name}\n"
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "plot.png.png").exists() and not list(tmp_path.glob("plot.v2*.png"))
    before = tree(tmp_path)
    for out, needle in [
        ("/", "--out /: is a directory; --out names the PNG file to write, e.g. --out /metrics.png"),
        (str(tmp_path), "is a directory"),
        (str(tmp_path / "gone") + "/", "is a directory"),
        ("", "is a directory"),
        (str(tmp_path / "plot.pdf"), "plot writes a PNG, not a .pdf file: name it plot.png"),
        (str(run / "config.yaml"), "exists and is not a PNG; refusing to overwrite it: choose another file"),
    ]:
        one_error(main("plot", str(run), "--out", out), needle)
    assert not Path("/.png").exists() and not Path("/metrics.png").exists()
    (run / "metrics.png").write_text("a person's notes\n")  # the default output, someone else's file
    one_error(main("plot", str(run)), "(the default --out): exists and is not a PNG", "pass --out")
    assert (run / "metrics.png").read_text() == "a person's notes\n"
    assert tree(tmp_path) == {**before, "run/metrics.png": b"a person's notes\n"}


# ---------------------------------------------------------------------------------------------
# render


def test_render_writes_only_into_its_own_directories_and_refuses_ignored_flags(tmp_path):
    assert not Path("/zero1.json").exists()
    one_error(main("render", "--all", "--out-dir", "/"), "--out-dir /:", "not written by `pretrain render`")
    assert not Path("/zero1.json").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    one_error(main("render", "--all", "--out-dir", str(mine)), f"{mine / 'notes.txt'} not written by")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    fresh = tmp_path / "fresh"
    assert ok(main("render", "--all", "--out-dir", str(fresh))).startswith("wrote 11 files")
    (fresh / "zero1.json.tmp-4242").write_text("{")  # a write that was killed: ours, not refused
    (fresh / "zero2.json").write_text('{"train_batch_size": 8}\n')  # now someone else's
    one_error(main("render", "--all", "--out-dir", str(fresh)), f"{fresh / 'zero2.json'} not written by")
    (fresh / "zero2.json").unlink()
    ok(main("render", "--all", "--out-dir", str(fresh)))

    for argv, needle in [
        (["--out-dir", str(fresh)], "--out-dir applies only with --all"),
        (["--check"], "--check applies only with --all"),
        (["--check", "--out-dir", "x"], "--check and --out-dir apply only with --all"),
        (["--all", "--preset", "small"], "--preset would be ignored"),
        (["--all", "--world-size", "2", "--set", "zero.stage=2"], "--set, --world-size would be ignored"),
    ]:
        one_error(main("render", *argv), needle)
    assert json.loads(ok(main("render", "--world-size", "2")))["train_batch_size"] > 0


# ---------------------------------------------------------------------------------------------
# export checksums; numbers in another base, or past any machine


def test_a_flipped_byte_in_an_export_is_refused_by_sample_naming_the_file(rope_export, tmp_path):
    """pretrain.json records the size and sha256 of the export's other files; sample checks them as it
    checks a checkpoint's (a flipped byte in the weights was sampled from, unseen)."""
    out = tmp_path / "export"
    shutil.copytree(rope_export, out)
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x01  # one bit of a weight: still a finite number, the file still parses
    weights.write_bytes(bytes(data))
    one_error(
        main("sample", str(out), "--max-new-tokens", "4"),
        f"{weights}: its sha256 differs from the one recorded at export",
        f"export it again (pretrain export {json.loads((out / 'pretrain.json').read_text())['source']} --out",
    )
    ok(main("sample", str(out), "--max-new-tokens", "4", "--no-checksums"))  # sizes only, as for a checkpoint
    (out / "hf" / "config.json").write_text("{}")
    one_error(main("sample", str(out), "--no-checksums"), f"{out / 'hf' / 'config.json'}: 2 bytes, ")
    # An export made before the checksums were recorded is read as it is, and said so.
    shutil.rmtree(out)
    shutil.copytree(rope_export, out)
    info = json.loads((out / "pretrain.json").read_text())
    del info["files"]
    (out / "pretrain.json").write_text(json.dumps(info))
    done = main("sample", str(out), "--max-new-tokens", "4")
    assert ok(done) and "records no checksums" in done.stderr and "export it again" in done.stderr


def test_an_integer_in_another_base_is_refused_with_its_decimal():
    """YAML 1.1 read `--set model.n_layer=0x10` as 16, `0b11` as 3 and `1:30` as 90, silently."""
    for value, needle in [
        ("0x10", "a hexadecimal number (16); write it in decimal (16), or quote it where text is meant"),
        ("0b11", "a binary number (3)"),
        ("1:30", "a base 60 number (90)"),
    ]:
        one_error(main("config", "--set", f"model.n_layer={value}"), f"--set 'model.n_layer={value}'", needle)
    one_error(main("config", "--set", "model.n_layer='0x10'"), "model.n_layer", "valid integer")  # text
    assert "n_layer: 16" in ok(main("config", "--set", "model.n_layer=16"))


def test_plan_and_render_refuse_infinite_sizes_and_world_sizes_past_any_machine():
    for argv, needle in [
        (["plan", "--world-size", "1000000000000"], "--world-size: 1000000000000 is out of range: a whole "
         "number at least 1 and at most 1048576"),
        (["plan", "--world-size", "1e12"], "--world-size: '1e12' is not a whole number"),
        (["render", "--world-size", "1" + "0" * 20], "--world-size: 1" + "0" * 20 + " is out of range"),
        *[(["plan", flag, "inf"], f"argument {flag}: inf is out of range: a finite number above 0")
          for flag in ("--peak-tflops", "--host-gb", "--gpu-gb", "--busbw", "--node-busbw")],
    ]:  # fmt: skip
        one_error(main(*argv), needle)
