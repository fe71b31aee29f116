"""The environment DeepSpeed and torch read, checked before a command imports them: every empty or
malformed value is one line naming the variable and the fix, on the commands that import DeepSpeed."""

from __future__ import annotations

import subprocess

import pytest

from pretrain.cluster import environment
from tests.conftest import BIN, subprocess_env


def test_the_accelerators_are_deepspeeds():
    from deepspeed.accelerator.real_accelerator import SUPPORTED_ACCELERATOR_LIST

    assert sorted(environment.ACCELERATORS) == sorted(SUPPORTED_ACCELERATOR_LIST)


@pytest.mark.parametrize(
    "env, line",
    [
        (
            {"DS_ACCELERATOR": ""},
            "DS_ACCELERATOR is set but empty: unset it (unset DS_ACCELERATOR) or set it to cuda, cpu",
        ),
        ({"DS_ACCELERATOR": "gpu"}, "DS_ACCELERATOR is 'gpu', not an accelerator DeepSpeed has"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is set but empty: set it to rank 0's host name or address"),
        ({"MASTER_ADDR": "node 1"}, "MASTER_ADDR is 'node 1', with white space in it"),
        ({"MASTER_PORT": "29 500"}, "MASTER_PORT is '29 500', not a port number: set it to a free port"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT is '70000', not a port number"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK is '-1', not a whole number from 0: the launcher sets it"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE is '0', not a whole number from 1"),
        ({"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES is set but empty, which hides every GPU"),
        ({"CUDA_VISIBLE_DEVICES": "0,,1"}, "CUDA_VISIBLE_DEVICES is '0,,1': '' is not a GPU index or UUID"),
        (
            {"DS_BUILD_CPU_ADAM": "true"},
            "DS_BUILD_CPU_ADAM is 'true': DeepSpeed's build switches take 0 or 1",
        ),
    ],
)
def test_each_bad_value_is_one_line_naming_the_variable_and_the_fix(env, line):
    found = environment.problems(env)
    assert len(found) == 1 and found[0].startswith(f"environment: {line}"), found


def test_good_values_and_unset_variables_pass():
    good = {
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "LOCAL_RANK": "3",
        "RANK": "11",
        "WORLD_SIZE": "16",
        "CUDA_VISIBLE_DEVICES": "0,1,GPU-8f6c2a1e-3b4d-4c5e-9f00-1a2b3c4d5e6f,MIG-GPU-8f6c2a1e/1/0",
        "DS_BUILD_FUSED_ADAM": "1",
    }
    assert environment.problems(good) == []
    assert environment.problems({}) == []
    # every GPU hidden on purpose, for a run on the CPU
    assert environment.problems({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}) == []


def test_every_problem_at_once():
    found = environment.problems({"DS_ACCELERATOR": "", "MASTER_PORT": "x", "DS_BUILD_AIO": ""})
    assert [f.split()[1] for f in found] == ["DS_ACCELERATOR", "MASTER_PORT", "DS_BUILD_AIO"]


def test_an_empty_ds_accelerator_is_one_line_before_deepspeed_is_imported():
    env = {**subprocess_env(), "DS_ACCELERATOR": ""}
    res = subprocess.run(
        [str(BIN / "pretrain"), "render", "--preset", "tiny"], env=env, capture_output=True, text=True
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: environment: DS_ACCELERATOR is set but empty: unset it (unset DS_ACCELERATOR) or set it to "
        "cuda, cpu or another DeepSpeed accelerator (xpu, npu, mps, hpu, mlu, sdaa, supa, klxpu); unset, "
        "DeepSpeed picks this machine's"
    ], res.stderr
    assert res.stdout == ""
    # a command that does not import DeepSpeed is not held up by it
    res = subprocess.run([str(BIN / "pretrain"), "config"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
