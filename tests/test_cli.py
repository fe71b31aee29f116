"""End to end through the command line: prepare, train, resume; the deepspeed launcher; bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TINY_SHAKESPEARE, subprocess_env

BIN = Path(sys.executable).parent

SMALL = [
    "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
    "--set", "model.block_size=32", "--set", "batch.micro_batch_size=4", "--set", "schedule.warmup_steps=1",
    "--set", "logging.log_interval=1", "--set", "logging.eval_interval=3", "--set", "logging.eval_batches=2",
    "--set", "logging.sample_tokens=20", "--set", "checkpoint.interval=3", "--set", "checkpoint.keep_last=2",
]  # fmt: skip


def run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


def steps_logged(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open() as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r["loss"]]


@pytest.mark.distributed
def test_prepare_train_resume(tmp_path):
    data = [f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={tmp_path / 'data'}"]
    run_dir = tmp_path / "run"
    out = run([str(BIN / "pretrain"), "prepare", *data], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "train 1,003,854 tokens" in out.stdout and "vocab 65" in out.stdout

    common = [*data, *SMALL, f"--set=logging.run_dir={run_dir}"]
    first = run([str(BIN / "pretrain"), "train", *common, "--set", "schedule.max_steps=6"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert steps_logged(run_dir) == [1, 2, 3, 4, 5, 6]
    assert "--- sample" in first.stdout and "val_loss" in first.stdout
    for name in ["config.yaml", "ds_config.json", "versions.json", "metrics.csv"]:
        assert (run_dir / name).is_file(), name
    versions = json.loads((run_dir / "versions.json").read_text())
    assert versions["versions"]["deepspeed"] and "commit" in versions["code"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step_00000003",
        "step_00000006",
    ]

    second = run(
        [str(BIN / "pretrain"), "train", *common, "--resume", "--set", "schedule.max_steps=10"], tmp_path
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "at step 6" in second.stdout
    assert steps_logged(run_dir) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # keep_last=2: the newest two remain
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step_00000009",
        "step_00000010",
    ]


@pytest.mark.distributed
def test_deepspeed_launcher_two_ranks_with_a_ds_config(tmp_path):
    """`deepspeed pretrain/main.py --ds ds_configs/zero2_offload.json`, with the launcher's --local_rank."""
    run_dir = tmp_path / "run"
    cmd = [
        str(BIN / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", "29533",
        str(ROOT / "pretrain" / "main.py"), "--ds", str(ROOT / "ds_configs" / "zero2_offload.json"),
        "--preset", "tiny",  # the JSON records gpt-6.7b (GPT-2 BPE); this test trains the char-level tiny
        "--set", "batch.data_parallel_size=2", "--set", "batch.gradient_accumulation_steps=2",
        "--set", "precision.bf16=false", "--set", "model.activation_checkpointing=false",
        f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={tmp_path / 'data'}",
        *SMALL, f"--set=logging.run_dir={run_dir}", "--set", "schedule.max_steps=4",
    ]  # fmt: skip
    out = run(cmd, tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "--local_rank=" in out.stdout + out.stderr  # the launcher injected it and main.py accepted it
    assert steps_logged(run_dir) == [1, 2, 3, 4]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["train_batch_size"] == 4 * 2 * 2
    assert (run_dir / "checkpoints" / "step_00000003" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()


def test_a_public_bert_config_trains_without_bias_correction_in_deepspeeds_cpu_adam(tmp_path):
    """DeepSpeedExamples' BERT recipe (Adam, bias_correction false, no scheduler) with its optimizer
    offloaded at ZeRO-1 (its gradient_predivide_factor rules out 2 and 3): DeepSpeedCPUAdam (the
    kernel the offload tests build) without bias correction, fp32 on one rank (the CPU has no fp16),
    the LR constant."""
    run_dir = tmp_path / "run"
    ds = ROOT / "tests" / "ds_json" / "public" / "ds_examples__bing_bert_progressive_layer_drop.json"
    cmd = [
        str(BIN / "pretrain"), "train", "--ds", str(ds), "--preset", "tiny",
        "--set", "batch.data_parallel_size=1", "--set", "batch.gradient_accumulation_steps=1",
        "--set", "precision.fp16=false", "--set", "zero.stage=1", "--set", "zero.offload_optimizer=true",
        f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={tmp_path / 'data'}",
        *SMALL, f"--set=logging.run_dir={run_dir}", "--set", "schedule.max_steps=3",
        "--set", "schedule.warmup_steps=0",  # SMALL's warmup off again: the JSON's constant LR
    ]  # fmt: skip
    out = run(cmd, tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert steps_logged(run_dir) == [1, 2, 3]
    params = json.loads((run_dir / "ds_config.json").read_text())["optimizer"]["params"]
    assert (params["bias_correction"], params["lr"]) == (False, 1e-3)
    with (run_dir / "metrics.csv").open() as f:
        assert {float(r["lr"]) for r in csv.DictReader(f) if r["loss"]} == {1e-3}


def one_screen_error(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    assert out.stderr.startswith("error: ")
    assert len(out.stderr.splitlines()) < 25
    for needle in needles:
        assert needle in out.stderr, out.stderr


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_bad_config_is_a_one_screen_error(tmp_path, command):
    out = run(
        [
            str(BIN / "pretrain"),
            command,
            "--set",
            "model.n_embd=100",
            "--set",
            "model.n_head=3",
            "--set",
            "zero.stage=7",
            "--set",
            "optimizer.lrr=1",
        ],
        tmp_path,
    )
    one_screen_error(
        out,
        "model: n_embd (100) must be divisible by n_head (3)",
        "zero.stage",
        "optimizer.lrr: unknown field (did you mean 'lr'?)",
    )


def test_train_reports_a_bad_config_before_loading_torch(tmp_path):
    """A typo in `pretrain train` is answered before torch and DeepSpeed load (seconds of imports),
    by the same check, with every problem; so is a bad --set under a launcher's variables."""
    code = (
        "import sys; from pretrain import cli; "
        "rc = cli.main(['train', '--set', 'optimizer.lrr=1', '--set', 'model.n_head=3']); "
        "print('rc', rc, 'torch loaded', 'torch' in sys.modules)"
    )
    for launcher in ({}, {"RANK": "0", "WORLD_SIZE": "2"}):
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(**launcher),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert "rc 2 torch loaded False" in out.stdout, out.stdout + out.stderr
        assert "optimizer.lrr: unknown field (did you mean 'lr'?)" in out.stderr
        assert "n_embd (128) must be divisible by n_head (3)" in out.stderr


def test_missing_corpus_is_a_one_screen_error(tmp_path):
    out = run(
        [
            str(BIN / "pretrain"),
            "train",
            f"--set=data.corpus={tmp_path / 'nope.txt'}",
            f"--set=data.dataset_dir={tmp_path / 'data'}",
        ],
        tmp_path,
    )
    one_screen_error(out, str(tmp_path / "nope.txt"))
    assert not (tmp_path / "data").exists()


def test_unknown_deepspeed_key_is_a_one_screen_error(tmp_path):
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["gradient_clippping"] = 1.0
    ds["zero_optimization"]["stage3_bogus"] = 1
    bad = tmp_path / "bad_ds.json"
    bad.write_text(json.dumps(ds))
    out = run([str(BIN / "pretrain"), "render", "--ds", str(bad), "--world-size", "16"], tmp_path)
    one_screen_error(
        out, "'gradient_clippping' is not a DeepSpeed config key (did you mean 'gradient_clipping'?)"
    )
    del ds["gradient_clippping"]
    bad.write_text(json.dumps(ds))
    out = run([str(BIN / "pretrain"), "render", "--ds", str(bad), "--world-size", "16"], tmp_path)
    one_screen_error(out, "stage3_bogus")


def test_render_all_check_passes_on_the_committed_files(tmp_path):
    out = run(
        [str(BIN / "pretrain"), "render", "--all", "--check", "--out-dir", str(ROOT / "ds_configs")], tmp_path
    )
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------------------------------------
# Numbers out of range, and files that are not what they should be: one line, exit 2, no traceback


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["config", "--world-size", "0"],
            "argument --world-size: 0 is out of range: a whole number at least 1",
        ),
        (["render", "--world-size", "-2"], "argument --world-size: -2 is out of range"),
        (["plan", "gpt2-124m", "--world-size", "abc"], "argument --world-size: 'abc' is not a whole number"),
        (
            ["plan", "gpt2-124m", "--mfu", "1.5"],
            "argument --mfu: 1.5 is out of range: a number above 0 and at most 1",
        ),
        (["plan", "gpt2-124m", "--gpu-gb", "nan"], "argument --gpu-gb: nan is out of range"),
        (
            ["train", "--max-restarts", "-1"],
            "argument --max-restarts: -1 is out of range: a whole number at least 0",
        ),
        (["train", "--nproc-per-node", "0"], "argument --nproc-per-node: 0 is out of range"),
        (
            ["sample", "x", "--temperature", "-1"],
            "argument --temperature: -1 is out of range: a number at least 0",
        ),
        (["sample", "x", "--top-k", "-1"], "argument --top-k: -1 is out of range"),
        (["sample", "x", "--num-samples", "0"], "argument --num-samples: 0 is out of range"),
        (
            ["sample", "x", "--max-new-tokens", "1e3"],
            "argument --max-new-tokens: '1e3' is not a whole number",
        ),
        (
            ["preflight", "--hostfile", "h", "--master-port", "70000"],
            "argument --master-port: 70000 is out of range",
        ),
        (["convert", "x", "--workers", "0"], "argument --workers: 0 is out of range"),
        (["data", "prepare", "--workers", "-1"], "argument --workers: -1 is out of range"),
    ],
)
def test_numbers_out_of_range_are_one_line_errors(argv, needle, capsys):
    from pretrain.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and needle in err and "Traceback" not in err, err


def test_duplicate_keys_and_binary_files_are_one_screen_errors(tmp_path, capsys):
    from pretrain.cli import main

    (tmp_path / "run.yaml").write_text("model:\n  n_layer: 3\n  n_layer: 4\n")
    (tmp_path / "ds.json").write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    (tmp_path / "blob").write_bytes(bytes(range(256)) * 4)
    cases = [
        (["config", "--config", str(tmp_path / "run.yaml")], "duplicate key 'n_layer': give each key once"),
        (
            ["config", "--preset", "tiny", "--ds", str(tmp_path / "ds.json")],
            "duplicate key 'train_batch_size'",
        ),
        (["config", "--config", str(tmp_path / "blob")], "blob: not UTF-8 text"),
        (["hostfile", str(tmp_path / "blob")], "not UTF-8 text"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "Traceback" not in err, err


def detected_accelerator_env() -> dict[str, str]:
    """The environment without DS_ACCELERATOR: DeepSpeed detects the accelerator itself, and on a
    machine without a GPU logs "Setting accelerator to CPU" as it loads."""
    return {k: v for k, v in subprocess_env().items() if k != "DS_ACCELERATOR"}


@pytest.mark.parametrize(
    ("args", "parse"),
    [
        (["render"], json.loads),
        (["render", "--preset", "gpt2-124m", "--world-size", "8"], json.loads),
        (["plan", "--json"], json.loads),
        (["config"], yaml.safe_load),
        (["config", "--ds", str(ROOT / "ds_configs" / "zero2.json")], yaml.safe_load),
    ],
)
def test_machine_output_is_exactly_its_format_on_stdout(tmp_path, args, parse):
    """`pretrain render | python -m json.tool` works: DeepSpeed's log lines go to stderr."""
    out = subprocess.run(
        [str(BIN / "pretrain"), *args], cwd=tmp_path, env=detected_accelerator_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert isinstance(parse(out.stdout), dict), out.stdout[:2000]


def test_deepspeeds_log_lines_follow_stderr_where_a_caller_redirects_it(tmp_path):
    """In-process callers of cli.main (the fuzz test; logs.py) capture stderr per call: DeepSpeed's lines
    land in the stderr of the moment, never on stdout."""
    code = (
        "import contextlib, io\n"
        "from pretrain import logs\n"
        "logs.deepspeed_logs_to_stderr()\n"
        "from deepspeed.utils import logger\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    logger.warning('a DeepSpeed warning')\n"
        "print('captured:', 'a DeepSpeed warning' in err.getvalue())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=detected_accelerator_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == "captured: True\n", out.stdout + out.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["config", "--config", "a.yaml", "--config", "b.yaml"],
            "--config given twice ('a.yaml', then 'b.yaml')",
        ),
        (["config", "--preset", "tiny", "--preset", "small"], "--preset given twice ('tiny', then 'small')"),
        (["render", "--ds", "a.json", "--deepspeed_config", "b.json"], "--deepspeed_config given twice"),
        (["train", "--preset", "tiny", "--preset", "small"], "--preset given twice"),
    ],
)
def test_a_config_option_given_twice_is_refused_not_half_dropped(argv, needle, capsys):
    """The last of two --config (--preset, --ds) used to win silently: the first file's settings were
    dropped without a word."""
    from pretrain.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_plan_with_a_preset_named_twice_is_refused(capsys):
    from pretrain.cli import main

    assert main(["plan", "gpt2-124m", "--preset", "tiny"]) == 2
    assert "two presets, gpt2-124m and --preset tiny: give one" in capsys.readouterr().err
    assert main(["plan", "tiny", "--preset", "tiny", "--json"]) == 0  # the same one twice is one


def test_commands_print_no_accelerator_or_deprecation_noise(tmp_path):
    """Without DS_ACCELERATOR set, DeepSpeed says "Setting accelerator to CPU. If you have GPU ... we
    were unable to detect it" wherever it is imported: said only on a machine with a GPU device node."""
    env = {k: v for k, v in subprocess_env().items() if k != "DS_ACCELERATOR"}
    gpu_node = any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()
    for args in (["render"], ["plan", "--preset", "tiny"]):
        done = subprocess.run(
            [sys.executable, "-m", "pretrain.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert ("Setting accelerator to CPU" in done.stderr) == gpu_node, done.stderr
        assert "Warning" not in done.stderr, done.stderr
