"""Generation with the KV cache: the tokens of the cache-less path (greedy, and sampled from the same
seeds), for both archs, learned and rotary positions, grouped-query attention, tied and untied
heads, prompts shorter and longer than block_size and generation past it; stop strings; prompts of
different lengths in one batch; and `pretrain sample`'s --stop, --prompt, --prompt-file and
--no-kv-cache, on an export of a model made here (no training run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models

from pretrain.config.tree import RunConfig
from pretrain.data.tokenizer import CharTokenizer, HFTokenizer
from pretrain.export import INFO, TOKENIZER, WEIGHTS, load_model, write_hf
from pretrain.generate import SampleCount, _Continuation, _ended_line, generate, stream_samples
from pretrain.training.model.gpt import GPT, KVCache
from tests.test_fuzz_commands import main, ok
from tests.test_safety import one_error

VOCAB = 50
BLOCK = 16
SHAPES = {
    "gpt2-learned": {"position": "learned"},
    "gpt2-learned-untied": {"position": "learned", "tie_embeddings": False},
    "gpt2-rope": {"position": "rope"},
    "pythia": {"position": "rope", "rotary_pct": 0.25, "parallel_residual": True},  # RoPE on 2 of 8 dims
    "llama-gqa": {"arch": "llama", "n_kv_head": 2},  # 4 query heads share 2 key/value heads
    "llama-gqa-untied": {"arch": "llama", "n_kv_head": 1, "tie_embeddings": False},
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(shape: str, vocab: int = VOCAB, seed: int = 0) -> GPT:
    model = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": BLOCK, "vocab_size": vocab}
    gpt = GPT(RunConfig.model_validate({"model": {**model, **SHAPES[shape]}}).model)
    gpt.reset_parameters(seed)
    return gpt.eval()


def tokens(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# The model's cache


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prompt_len", [1, 5, BLOCK, BLOCK + 7])
def test_greedy_with_the_cache_is_greedy_without(shape: str, prompt_len: int) -> None:
    """Greedy (top_k 1) tokens are the cache-less path's, from prompts shorter than, as long as and
    longer than block_size, for twice block_size tokens: past it the window slides."""
    model = make_model(shape)
    prompt = tokens(2, prompt_len, seed=prompt_len)
    cached = model.generate(prompt, 2 * BLOCK, top_k=1)
    assert torch.equal(cached, model.generate(prompt, 2 * BLOCK, top_k=1, kv_cache=False))
    assert cached.shape == (2, prompt_len + 2 * BLOCK)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cached_logits_are_the_whole_context_logits_at_every_step(shape: str) -> None:
    """Fed a random token stream (not the model's own, often repetitive, choices) for three times
    block_size steps, the cached next-token logits match a forward of the whole window at every
    step, before and after the window starts to slide."""
    model = make_model(shape)
    stream = tokens(3, 3 * BLOCK, seed=1)
    cache = KVCache(model.cfg.n_layer, BLOCK)
    with torch.no_grad():
        for t in range(3, stream.size(1) + 1):
            idx = stream[:, :t]
            cached = model.next_logits(idx, cache)
            whole = model(idx[:, -BLOCK:])[0][:, -1, :]
            torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-6)
            assert torch.equal(cached.argmax(-1), whole.argmax(-1))


def test_the_cache_computes_one_token_a_step_until_the_window_slides() -> None:
    """What each forward takes: the prompt, then one token a step while the context fits block_size;
    once it slides, the whole window (every position moved), as without the cache."""
    model = make_model("gpt2-learned")
    seen: list[int] = []
    model.wte.register_forward_hook(lambda _m, args, _out: seen.append(args[0].size(1)))
    model.generate(tokens(1, 5), BLOCK, top_k=1)
    assert seen == [5] + [1] * (BLOCK - 5) + [BLOCK] * 4
    seen.clear()
    model.generate(tokens(1, 5), BLOCK, top_k=1, kv_cache=False)
    assert seen == list(range(5, BLOCK + 1)) + [BLOCK] * 4


@pytest.mark.parametrize("shape", ["gpt2-learned", "gpt2-rope", "pythia", "llama-gqa"])
def test_a_forward_in_chunks_with_the_cache_is_the_whole_forward(shape: str) -> None:
    """Several new tokens after cached ones see the cached ones and each other causally."""
    model = make_model(shape)
    idx = tokens(2, BLOCK, seed=2)
    cache = KVCache(model.cfg.n_layer, BLOCK)
    with torch.no_grad():
        for a, b in [(0, 4), (4, 5), (5, 11), (11, BLOCK)]:
            logits, _ = model(idx[:, a:b], cache=cache)
            torch.testing.assert_close(logits, model(idx[:, :b])[0], rtol=1e-5, atol=1e-6)
        assert cache.pos == BLOCK
        with pytest.raises(ValueError, match="block_size is 16"):
            model(idx[:, :1], cache=cache)


# ---------------------------------------------------------------------------------------------
# Sampling (pretrain.export): prompts in batches, stop strings

CHARS = CharTokenizer(list("abcdefghij \n.,"))  # 14 characters; the models' vocabularies are padded


def test_sampled_text_with_the_cache_is_the_text_without() -> None:
    """At temperature 1 from one seed (every token drawn, not only the likeliest): the same text,
    past block_size too, for each of several samples made side by side."""
    for shape in ("gpt2-learned", "llama-gqa"):
        model = make_model(shape)
        args = (model, CHARS, "abc", 3 * BLOCK, 1.0, None, 11)
        with_cache = generate(*args, num_samples=3)
        assert with_cache == generate(*args, num_samples=3, kv_cache=False)
        assert len(set(with_cache)) == 3 and all(len(t) == 3 + 3 * BLOCK for t in with_cache)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_prompts_of_different_lengths_in_one_batch_are_each_made_as_alone(kv_cache: bool) -> None:
    """Batched prompts (some as long, one longer than block_size) come back in order, each prompt's
    samples the ones it has alone: greedy, and sampled from seed + i."""
    model = make_model("gpt2-rope")
    prompts = ["ab", "badge" * 5, "j", "cd", "", "a.b,c"]
    greedy = generate(model, CHARS, prompts, 24, 1.0, 1, 0, kv_cache=kv_cache)
    assert greedy == [generate(model, CHARS, p, 24, 1.0, 1, 0, kv_cache=kv_cache)[0] for p in prompts]
    sampled = generate(model, CHARS, prompts, 24, 0.9, None, 5, num_samples=2, kv_cache=kv_cache)
    for p, prompt in enumerate(prompts):
        assert sampled[2 * p : 2 * p + 2] == generate(
            model, CHARS, prompt, 24, 0.9, None, 5, 2, kv_cache=kv_cache
        )
    assert sampled[0].startswith("ab") and sampled[2].startswith(("badge" * 5)[-BLOCK:])  # cropped


def test_a_stop_string_held_back_across_pieces() -> None:
    end = _Continuation(["\n\n", "xyz"])
    assert end.add("ab") == "ab"
    assert end.add("c\n") == "c"  # "\n" may begin "\n\n"
    assert end.add("d") == "\nd"
    assert end.add("xy") == ""
    assert end.add("q\n\nrest") == "xyq" and end.done  # the first stop string ends it; not shown
    early = _Continuation(["b", "abc"])
    assert early.add("zabc") == "z" and early.done  # cut where the first one to begin begins
    last = _Continuation(["\n\n"])
    assert last.add("a\n") == "a" and last.add("", final=True) == "\n" and not last.done


def test_a_stop_string_ends_each_sample_before_it() -> None:
    """Each sample is its text without stop strings, cut before the first one; samples that stop
    leave the batch and the others go on as they would have; the stop string is not printed."""
    model = make_model("gpt2-learned")
    args = (model, CHARS, "ab", 40, 1.0, None, 3)
    free = generate(*args, num_samples=6)
    stop = free[0][12:14]  # two characters the first sample makes
    cut = [t[:2] + t[2:].split(stop)[0] if stop in t[2:] else t for t in free]
    assert generate(*args, num_samples=6, stop=[stop]) == cut
    assert generate(*args, num_samples=6, stop=[stop], kv_cache=False) == cut
    assert cut[0] == free[0][:2] + free[0][2:12].split(stop)[0]


def test_a_streamed_sample_stops_early_and_counts_its_tokens() -> None:
    """A sample made alone streams its pieces; a stop string ends it long before max_new_tokens
    (the generation stops, not only the printing), and the count is the tokens made."""
    model = make_model("llama-gqa")
    free = generate(model, CHARS, "ab", 30, 1.0, None, 4)[0]
    stop = free[20:22]
    count = SampleCount()
    pieces = list(stream_samples(model, CHARS, "ab", 1_000_000, 1.0, None, 4, stop=[stop], count=count))
    text = "".join(p for _, p in pieces)
    assert text == "ab" + free[2:].split(stop)[0]
    assert len(pieces) > 2 and {i for i, _ in pieces} == {0}
    assert count.tokens <= 20
    count = SampleCount()
    assert "".join(p for _, p in stream_samples(model, CHARS, "ab", 30, 1.0, None, 4, count=count)) == free
    assert count.tokens == 30


# ---------------------------------------------------------------------------------------------
# pretrain sample


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export as `pretrain export` lays it out (weights, info, tokenizer) of a llama model with
    grouped-query attention made here."""
    out = tmp_path_factory.mktemp("generate") / "export"
    out.mkdir()
    cfg = RunConfig.model_validate(
        {"model": {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
                   "block_size": BLOCK, "vocab_size": 16}, "data": {"tokenizer": "char"}}
    )  # fmt: skip
    model = GPT(cfg.model)
    model.reset_parameters(7)
    weights = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(weights, str(out / WEIGHTS))
    (out / INFO).write_text(json.dumps({"config": cfg.model_dump(mode="json")}))
    CHARS.save(out / TOKENIZER)
    return out


def sample(export_dir: Path, *argv: str) -> tuple[str, str]:
    done = main("sample", str(export_dir), *argv)
    return ok(done), done.stderr


def test_sample_prompts_in_one_batch_and_from_a_file(export_dir: Path, tmp_path: Path) -> None:
    """--prompt repeated: each prompt's text under its header, in order, as it comes alone; the same
    from --prompt-file's lines, and without the cache; tokens/s on stderr only."""
    prompts = ["ab", "badge badge badge badge", "j"]
    greedy = ["--top-k", "1", "--max-new-tokens", "30"]
    out, err = sample(export_dir, *[a for p in prompts for a in ("--prompt", p)], *greedy)
    alone = [sample(export_dir, "--prompt", p, *greedy)[0] for p in prompts]
    assert out == "".join(f"--- prompt {n + 1} ---\n{text}" for n, text in enumerate(alone))
    assert "tokens/s (with the KV cache, --device cpu)" in err and "90 tokens in" in err
    assert "tokens/s" not in out
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    assert sample(export_dir, "--prompt-file", str(tmp_path / "prompts.txt"), *greedy)[0] == out
    out_slow, err_slow = sample(
        export_dir, *[a for p in prompts for a in ("--prompt", p)], *greedy, "--no-kv-cache"
    )
    assert out_slow == out and "without the KV cache" in err_slow
    two = sample(
        export_dir, "--prompt", "ab", "--prompt", "cd", "--num-samples", "2", "--max-new-tokens", "3"
    )[0]
    assert [line for line in two.splitlines() if line.startswith("---")] == [
        "--- prompt 1, sample 1 ---", "--- prompt 1, sample 2 ---",
        "--- prompt 2, sample 1 ---", "--- prompt 2, sample 2 ---",
    ]  # fmt: skip


def test_sample_stop(export_dir: Path) -> None:
    """--stop ends the text before the first of the strings given; the string is not printed."""
    argv = ["--prompt", "ab", "--temperature", "1", "--top-k", "0", "--seed", "3", "--max-new-tokens", "60"]
    free = sample(export_dir, *argv)[0]
    stop = free[20:22]
    out, err = sample(export_dir, *argv, "--stop", stop, "--stop", "never there")
    assert out == "ab" + free[2:].split(stop)[0] + "\n"
    assert "60 tokens in" not in err


def test_sample_bad_prompts_and_stops(export_dir: Path, tmp_path: Path) -> None:
    done = main("sample", str(export_dir), "--stop", "")
    assert done.returncode == 2 and "argument --stop: an empty stop string" in done.stderr
    assert "Traceback" not in done.stderr
    one_error(main("sample", str(export_dir), "--prompt-file", str(tmp_path / "nope.txt")),
              f"--prompt-file {tmp_path / 'nope.txt'}: no such file", "one per line")  # fmt: skip
    one_error(main("sample", str(export_dir), "--prompt-file", str(tmp_path)), "is a directory")
    (tmp_path / "p.txt").write_text("ab\n")
    one_error(main("sample", str(export_dir), "--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")),
              "--prompt and --prompt-file both given", "give the prompts one way")  # fmt: skip
    (tmp_path / "empty.txt").write_text("")
    one_error(main("sample", str(export_dir), "--prompt-file", str(tmp_path / "empty.txt")), "empty")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    one_error(main("sample", str(export_dir), "--prompt-file", str(tmp_path / "latin1.txt")), "not UTF-8")
    one_error(main("sample", str(export_dir), "--prompt", "ab", "--prompt", "é"), "--prompt 2: character 'é'")
    one_error(
        main("sample", str(export_dir), "--prompt", "a", "--prompt", "b", "--max-new-tokens", "5000001"),
        "2 prompts x --num-samples 1 x --max-new-tokens 5000001",
    )


def test_a_sample_ends_at_the_end_of_text_and_says_why() -> None:
    """A sample ends at the tokenizer's end-of-text, which is not printed, as transformers' generate
    ends at the export's eos_token_id; `count.ended` and the line on stderr say why and when."""
    model = make_model("llama-gqa")
    free = generate(model, CHARS, "ab", 40, 1.0, None, 4)[0][2:]
    end = free[10]
    # CHARS' ids in a Hugging Face tokenizer, `end` its end-of-text: the same draws, ended at it
    hf = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS.chars)}, merges=[]))
    hf.decoder = decoders.Fuse()
    tok = HFTokenizer(hf.to_str().encode(), "chars", end)
    count = SampleCount()
    text = "".join(p for _, p in stream_samples(model, tok, "ab", 40, 1.0, None, 4, count=count))
    assert text == "ab" + free[: free.index(end)]
    assert count.ended == {0: ("end-of-text", free.index(end) + 1)} and count.tokens == free.index(end) + 1
    assert _ended_line(count.ended, 40, 1) == (
        f"ended before --max-new-tokens 40: at the end-of-text token after {free.index(end) + 1} tokens"
    )
    both = {0: ("end-of-text", 3), 2: ("--stop", 7)}
    assert _ended_line(both, 9, 3) == (
        "ended before --max-new-tokens 9: sample 1 at the end-of-text token after 3 tokens, "
        "sample 3 at a --stop string after 7 tokens"
    )


def test_greedy_is_transformers_do_sample_false(export_dir: Path, tmp_path: Path) -> None:
    """--temperature 0 and --greedy take the likeliest token each step: the text transformers'
    generate(do_sample=False) makes on the model's Hugging Face directory."""
    transformers = pytest.importorskip("transformers", reason="the dev extras install transformers")
    model, cfg, _ = load_model(export_dir)
    write_hf(tmp_path / "hf", cfg.model, model.state_dict(), "fp32", CHARS)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    for prompt in ("ab", "badge j"):
        ids = torch.tensor([CHARS.encode(prompt)])
        out = theirs.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
        want = CHARS.decode(out[0].tolist()) + "\n"
        assert (
            sample(export_dir, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8")[0] == want
        )
        assert sample(export_dir, "--prompt", prompt, "--greedy", "--max-new-tokens", "8")[0] == want
