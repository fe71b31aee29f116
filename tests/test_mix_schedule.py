"""A data mix that changes on schedule: the config's checks, the loader's block-by-block shares,
fixed weights unchanged to the bit, exact resume on another world size, and what plan and the log
say."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.config.loading import deep_merge, parse_override
from pretrain.config.mix import mix_points, shares_at, weight_at
from pretrain.config.tree import validate
from pretrain.data.dataset import Dataset, datasets_sha256, open_datasets
from pretrain.data.loader import _CHUNK, BLOCK, ShardedLoader, _interp
from pretrain.data.shards import write_shard
from pretrain.errors import ConfigError, DataError
from pretrain.plan.report import plan_json, render_mix
from pretrain.plan.target import Target
from pretrain.training.metrics import MetricsLog
from tests.test_loader import loaders, make_shards

TOKENS = BLOCK * 4  # tokens of one blend block at the loader tests' block_size 4


def shards_of(root: Path, samples: list[int], block_size: int = 4) -> list[list[Path]]:
    """One single-shard dataset per entry, of that many samples."""
    out = []
    for d, n in enumerate(samples):
        out.append([root / f"d{d}.bin"])
        write_shard(out[-1][0], (np.arange(n * block_size + 1) % 60_000).astype(np.uint16), n_docs=1)
    return out


def dataset_of(loader: ShardedLoader, ids: np.ndarray) -> np.ndarray:
    """Which dataset each global sample id belongs to."""
    return np.searchsorted(np.asarray(loader._offsets), ids, side="right") - 1


# ---------------------------------------------------------------------------------------------
# Fixed weights: today's order, bit for bit


def test_fixed_weights_give_the_same_order_as_before_schedules(tmp_path: Path) -> None:
    """The digests were taken with the loader before schedules existed (commit 2980a97)."""
    a = make_shards(tmp_path, [4 * 5000 + 1])
    b = make_shards(tmp_path, [4 * 3000 + 1], first=1)
    c = make_shards(tmp_path, [4 * 700 + 1, 4 * 2000 + 1], first=2)
    positions = np.concatenate([np.arange(0, 2 * BLOCK + 77), np.arange(10**9, 10**9 + 5000)])
    for weights, digest, taken in (
        ([3, 1], "1111a9e5412ef325", 750000115),
        ([0.5, 0.3, 0.2], "d4f304815aa4bf88", 500000088),
    ):
        groups = [a, b, c][: len(weights)]
        (fixed,) = loaders(groups, world=1, micro=2, accum=1, seed=3, weights=weights)
        ids = fixed.sample_ids(positions)
        assert hashlib.sha256(ids.astype(np.int64).tobytes()).hexdigest()[:16] == digest
        assert fixed._taken(0, 10**9 + 123) == taken
        # the same weights as one-point schedules: the scheduled path, the same stream
        (flat,) = loaders(groups, world=1, micro=2, accum=1, seed=3, weights=[[[0, w]] for w in weights])
        assert np.array_equal(flat.sample_ids(positions), ids)


# ---------------------------------------------------------------------------------------------
# A schedule, block by block


SCHEDULE = [
    [[0, 0.9], [4 * TOKENS, 0.1]],  # a ramp over blocks 0-4
    [[0, 0.1], [4 * TOKENS, 0.9]],
    [[0, 0.0], [2 * TOKENS, 0.0], [2 * TOKENS, 0.5]],  # a step: read from block 2 on
]


def test_each_blocks_shares_follow_the_schedule_and_each_dataset_its_own_epochs(tmp_path: Path) -> None:
    sizes = [3000, 2000, 1000]
    loader = ShardedLoader(
        shards_of(tmp_path, sizes), block_size=4, micro_batch_size=1, grad_accum=1, rank=0, world_size=1,
        seed=7, weights=SCHEDULE,
    )  # fmt: skip
    blocks = 6
    ds = dataset_of(loader, loader.sample_ids(np.arange(blocks * BLOCK)))
    for b in range(blocks):
        counts = np.bincount(ds[b * BLOCK : (b + 1) * BLOCK], minlength=3)
        expected = np.array(shares_at(SCHEDULE, b * TOKENS)) * BLOCK
        assert np.abs(counts - expected).max() <= 1, (b, counts, expected)  # largest remainders
        assert counts.tolist() == [round(s * BLOCK) for s in loader.mix(b * BLOCK)]
    assert (ds[: 2 * BLOCK] != 2).all() and (ds[2 * BLOCK :] == 2).any()  # weight 0, then the step
    # each dataset's positions take its samples in order across blocks of any share: every sample
    # once per epoch of that dataset, none skipped or repeated where a block's share changed
    ids = loader.sample_ids(np.arange(blocks * BLOCK))
    for d, n in enumerate(sizes):
        mine = ids[ds == d] - loader._offsets[d]
        for e in range(len(mine) // n):
            assert sorted(mine[e * n : (e + 1) * n].tolist()) == list(range(n))


def test_running_counts_match_a_plain_sum_and_a_far_position_is_cheap(tmp_path: Path) -> None:
    """At block_size 2048, 1e12 tokens is block 7450: the counts before it are summed once, a chunk
    of blocks at a time, then cached; past the schedule's last point every block is the same."""
    schedule = [[[0, 0.7], [5e11, 0.5], [1e12, 0.2]], [[0, 0.3], [1e12, 0.8]]]
    loader = ShardedLoader(
        shards_of(tmp_path, [3, 5], block_size=2048), block_size=2048, micro_batch_size=1, grad_accum=1,
        rank=0, world_size=1, seed=0, weights=schedule,
    )  # fmt: skip
    far = 10**12 // 2048
    start = time.perf_counter()
    loader.sample_ids(np.arange(far, far + 8))
    print(f"first batch at 1e12 tokens: {time.perf_counter() - start:.4f} s")
    mix = loader._mix
    assert mix.flat_from == -(-(10**12) // (BLOCK * 2048)) == 7451
    for b in (0, 1, _CHUNK - 1, _CHUNK, _CHUNK + 1, far // BLOCK, mix.flat_from, mix.flat_from + 1000):
        plain = mix.block_shares(np.arange(b)).sum(axis=0) if b else np.zeros(2, dtype=np.int64)
        assert mix.before(b).tolist() == plain.tolist(), b
    for b in (0, 3, 3000, 7450, 7451, 9000):  # the loader's weights are config.mix's, to the bit
        t = b * BLOCK * 2048.0
        at = [float(_interp(mix._ts[d], mix._ws[d], np.array([t]))[0]) for d in range(2)]
        assert at == [weight_at(s, t) for s in schedule]
        shares = mix.block_shares(np.array([b]))[0]
        assert shares.sum() == BLOCK and np.abs(shares - np.array(shares_at(schedule, t)) * BLOCK).max() < 1


# ---------------------------------------------------------------------------------------------
# Resume


def test_a_scheduled_mix_resumes_exactly_on_another_world_size(char_dataset: Path, tmp_path: Path) -> None:
    """Real prepared shards, through the config and open_datasets as a run opens them: 2 ranks from
    a position just before the mix moves, a saved state, then 1 rank; the same global batches as
    one uninterrupted rank, across the block where the shares change."""
    other = tmp_path / "hq"
    shutil.copytree(char_dataset, other)
    block_size = 8
    turn = 3 * BLOCK * block_size  # tokens at the start of block 3
    cfg = validate(
        {
            "model": {"block_size": block_size},
            "data": {
                "tokenizer": "char",
                "blend": [
                    {"dataset_dir": str(char_dataset), "weight": [[0, 0.8], [turn, 0.8], [turn, 0.1]]},
                    {"dataset_dir": str(other), "weight": 0.2},
                ],
            },
        }
    )
    datasets = open_datasets(cfg.data)

    def ranks(world: int, micro: int, accum: int) -> list[ShardedLoader]:
        return [
            ShardedLoader(
                [d.shard_paths("train") for d in datasets],
                block_size=block_size,
                micro_batch_size=micro,
                grad_accum=accum,
                rank=r,
                world_size=world,
                seed=cfg.data.seed,
                weights=[d.weight for d in datasets],
            )
            for r in range(world)
        ]

    def steps(group: list[ShardedLoader], n: int) -> list[torch.Tensor]:
        return [torch.cat([g.next_batch()[0] for g in group for _ in range(g.grad_accum)]) for _ in range(n)]

    (one,) = ranks(1, 8, 4)  # 32 samples a step
    start = {**one.state_dict(), "position": 3 * BLOCK - 5 * 32, "consumed_samples": 3 * BLOCK - 5 * 32}
    one.load_state_dict(start)
    uninterrupted = steps([one], 12)
    two = ranks(2, 4, 4)
    for r in two:
        r.load_state_dict(start)
    assert [torch.equal(a, b) for a, b in zip(steps(two, 6), uninterrupted[:6], strict=True)] == [True] * 6
    state = json.loads(json.dumps(two[0].state_dict()))  # as a checkpoint keeps it
    assert state == json.loads(json.dumps(two[1].state_dict()))
    (resumed,) = ranks(1, 16, 2)
    resumed.load_state_dict(state)
    assert [torch.equal(a, b) for a, b in zip(steps([resumed], 6), uninterrupted[6:], strict=True)] == [
        True
    ] * 6
    # the mix moved on the way, realized in whole samples of a block
    assert one.mix(start["position"]) == pytest.approx([0.8, 0.2], abs=1 / BLOCK)
    assert one.mix() == pytest.approx([1 / 3, 2 / 3], abs=1 / BLOCK)


def test_a_changed_schedule_is_refused_on_resume(tmp_path: Path) -> None:
    groups = shards_of(tmp_path, [300, 200, 100])
    (saved,) = loaders(groups, world=1, micro=4, accum=1, weights=SCHEDULE)
    saved.next_batch()
    state = json.loads(json.dumps(saved.state_dict()))
    for same in loaders(groups, world=2, micro=2, accum=1, weights=SCHEDULE):
        same.load_state_dict(state)  # the same schedule, on another world size
    moved = [SCHEDULE[0], SCHEDULE[1], [[0, 0.0], [3 * TOKENS, 0.0], [3 * TOKENS, 0.5]]]
    for weights, d in ((moved, 2), ([1, 1, 1], 0)):
        (other,) = loaders(groups, world=1, micro=4, accum=1, weights=weights)
        with pytest.raises(
            DataError,
            match=rf"saved with other blend weights \(data\.blend\[{d}\]: .* then, .* now\): .* resume with data\.blend's",
        ):
            other.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# Config, fingerprint, plan and log


def blend(*weights: object) -> dict:
    return {"data": {"blend": [{"dataset_dir": f"data/d{i}", "weight": w} for i, w in enumerate(weights)]}}


def test_schedules_are_checked_every_problem_at_once() -> None:
    cases = [
        (blend([[5, 0.7], [1, 0.2]], 0.3), "data.blend.0.weight: points must be in order of tokens"),
        (blend([[0, -1]], 1), "data.blend.0.weight: point [0.0, -1.0]: tokens and weight must be finite"),
        (blend([[0, 0.5], [1, 1], [1, 2], [1, 3]], 1), "3 points at 1 tokens: two make a step"),
        (blend([[0, 0], [10, 0]], 1), "every point's weight is 0: the dataset is never read"),
        (blend(0, 1), "a fixed weight must be a finite number above 0, got 0: drop a dataset"),
        (blend([0.5], 1), "a weight is a number or a list of [tokens, weight] points"),
        (
            blend([[0, 1], [8e9, 0]], [[0, 1], ["1e10", 0]]),
            "data.blend: at 10,000,000,000 tokens every weight is 0",
        ),
        (
            blend([[0, 1], [8e9, 1e-6]], 1),
            "at 8,000,000,000 tokens data.blend[0]'s share is 1e-06, under 1/65536",
        ),
    ]
    for data, says in cases:
        with pytest.raises(ConfigError) as e:
            validate(deep_merge(data, {"model": {"n_layer": 0}}))
        assert says in str(e.value) and "model.n_layer" in str(e.value), str(e.value)  # every problem at once
        assert all("; " not in p for p in e.value.problems)
    # as --set writes it: YAML leaves 8e9 as text, read as the number
    cfg = validate(
        parse_override(
            "data.blend=[{dataset_dir: a/web, weight: [[0, 0.7], [8e9, 0.7], [1e10, 0.2]]}, "
            "{dataset_dir: b/hq, weight: [[0, 0.3], [8e9, 0.3], [1e10, 0.8]]}]"
        )
    )
    assert cfg.data.blend[0].weight == [(0.0, 0.7), (8e9, 0.7), (1e10, 0.2)]
    assert shares_at([b.weight for b in cfg.data.blend], 9e9) == pytest.approx([0.45, 0.55])
    assert validate(blend([[0, 1], [8e9, 0]], [[0, 0], [8e9, 1]])).data.blend[1].weight[0] == (0.0, 0.0)


def test_the_fingerprint_plan_and_log_carry_the_schedule(char_dataset: Path, tmp_path: Path) -> None:
    manifest = json.loads((char_dataset / "manifest.json").read_text())
    fixed = datasets_sha256([Dataset(char_dataset, manifest, 0.5)])
    scheduled = datasets_sha256([Dataset(char_dataset, manifest, [(0.0, 0.5), (8e9, 0.2)])])
    assert fixed != scheduled != datasets_sha256([Dataset(char_dataset, manifest, [(0.0, 0.5), (9e9, 0.2)])])

    cfg = validate(
        deep_merge(
            blend([[0, 0.7], [8e9, 0.7], [1e10, 0.2]], [[0, 0.3], [8e9, 0.3], [1e10, 0.8]]),
            {
                "model": {"block_size": 1000, "vocab_size": 65},
                "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 1},
            },
        ),
        world_size=1,
    )
    lines = render_mix(cfg)
    assert lines[0].startswith("data mix (scheduled in tokens seen")
    assert lines[3] == "      10,000,000,000 tokens (step 10,000,000) (after the run ends): d0=0.20 d1=0.80"
    assert mix_points([b.weight for b in cfg.data.blend], tokens_per_step=1000)[1][:2] == (8e9, 8_000_000)

    points = plan_json(cfg, Target(world=1))["data_mix"]
    assert points[2] == {"tokens": 10**10, "step": 10**7, "shares": {"d0": 0.2, "d1": 0.8}}

    out = io.StringIO()
    log = MetricsLog(tmp_path, 100, out=out, world_size=1)
    for step, shares in ((0, [0.7, 0.3]), (10, [0.7, 0.3]), (20, [0.45, 0.55]), (30, [0.451, 0.549])):
        log.note_mix(step, cfg.data.blend, shares)
    log.close()
    assert out.getvalue().splitlines() == [
        "data mix at step 0: d0=0.70 d1=0.30 (scheduled in tokens seen: a line here when it changes)",
        "step 20: data mix now d0=0.45 d1=0.55",
    ]
