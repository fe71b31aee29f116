"""The loader: windows, an order that is a function of (seed, position) only, resume on any world
size, blending, prefetching; with its inputs checked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.data.loader import BLOCK, Permutation, ShardedLoader
from pretrain.data.shards import write_shard
from pretrain.errors import DataError

BLOCK_SIZE = 4


def make_shards(root: Path, sizes: list[int], first: int = 0) -> list[Path]:
    """Shard k holds k*10000 + 0, 1, 2, ... so a window's first token names its sample."""
    paths = []
    for k, n in enumerate(sizes, start=first):
        paths.append(root / f"shard{k}.bin")
        write_shard(paths[-1], (k * 10_000 + np.arange(n)).astype(np.uint16), n_docs=1)
    return paths


def sample_ids(x: torch.Tensor) -> list[tuple[int, int]]:
    """(shard, window) of each row of a batch."""
    return [(t // 10_000, (t % 10_000) // BLOCK_SIZE) for t in x[:, 0].tolist()]


def loaders(
    paths: list, world: int, micro: int, accum: int, seed: int = 0, **kw: object
) -> list[ShardedLoader]:
    return [
        ShardedLoader(
            paths,
            block_size=BLOCK_SIZE,
            micro_batch_size=micro,
            grad_accum=accum,
            rank=r,
            world_size=world,
            seed=seed,
            **kw,
        )
        for r in range(world)
    ]  # type: ignore[arg-type]


def global_batch(ranks: list[ShardedLoader]) -> list[tuple[int, int]]:
    """One optimizer step: each rank's micro batches, concatenated in rank order."""
    out = []
    for loader in ranks:
        for _ in range(loader.grad_accum):
            out += sample_ids(loader.next_batch()[0])
    return out


def global_batches(ranks: list[ShardedLoader], steps: int) -> list[list[tuple[int, int]]]:
    return [global_batch(ranks) for _ in range(steps)]


# 3 shards: windows (n - 1) // 4 = 5, 9, 2 -> 16 samples.
SIZES = [21, 39, 12]
ALL_SAMPLES = {(0, j) for j in range(5)} | {(1, j) for j in range(9)} | {(2, j) for j in range(2)}


def test_permutation_is_a_bijection_for_any_n() -> None:
    for n in [1, 2, 3, 16, 17, 1000, 65_537]:
        p = Permutation(n, (1, 2))
        out = p(np.arange(n))
        assert sorted(out.tolist()) == list(range(n))
        assert np.array_equal(out[n // 3 : n // 2], p(np.arange(n // 3, n // 2)))  # any slice, alone
    a, b = Permutation(1000, (1,))(np.arange(1000)), Permutation(1000, (2,))(np.arange(1000))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))


def test_loader_windows_and_shift(tmp_path: Path) -> None:
    (loader,) = loaders(make_shards(tmp_path, SIZES), world=1, micro=3, accum=1)
    assert loader.n_samples == 16
    x, y = loader.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, BLOCK_SIZE)
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(y, x + 1)  # the tokens count up within a shard
    assert all(t % BLOCK_SIZE == 0 for t in (x[:, 0] % 10_000).tolist())


def test_loader_order_depends_on_seed(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    a = global_batches(loaders(paths, 1, 4, 1, seed=1), 4)
    assert a == global_batches(loaders(paths, 1, 4, 1, seed=1), 4)
    assert a != global_batches(loaders(paths, 1, 4, 1, seed=2), 4)
    unshuffled = loaders(paths, world=1, micro=16, accum=1, seed=1, shuffle=False)[0]
    assert sample_ids(unshuffled.next_batch()[0]) == sorted(ALL_SAMPLES)


def test_every_sample_once_per_epoch_across_ranks(tmp_path: Path) -> None:
    ranks = loaders(make_shards(tmp_path, SIZES), world=2, micro=2, accum=2)  # global batch 8
    assert ranks[0].steps_per_epoch == 2
    epochs = []
    for _ in range(2):
        seen = [s for batch in global_batches(ranks, 2) for s in batch]
        assert len(seen) == 16 and set(seen) == ALL_SAMPLES
        epochs.append(seen)
    assert epochs[0] != epochs[1]


def test_epochs_are_runs_of_n_samples_even_when_batches_straddle_them(tmp_path: Path) -> None:
    (loader,) = loaders(make_shards(tmp_path, SIZES), world=1, micro=3, accum=2)  # 16 is not a multiple of 6
    stream = [s for batch in global_batches([loader], 8) for s in batch]  # 48 samples = 3 epochs
    for e in range(3):
        assert set(stream[16 * e : 16 * (e + 1)]) == ALL_SAMPLES
    assert loader.epoch == 3 and loader.consumed_samples == 48


def test_global_batches_do_not_depend_on_world_size(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    one = global_batches(loaders(paths, world=1, micro=3, accum=2), 7)  # crosses 2 epoch boundaries
    assert one == global_batches(loaders(paths, world=2, micro=3, accum=1), 7)
    assert one == global_batches(loaders(paths, world=3, micro=1, accum=2), 7)


@pytest.mark.parametrize("blend", [False, True])
@pytest.mark.parametrize("k", [1, 5])
def test_resume_two_ranks_then_one_equals_uninterrupted(tmp_path: Path, blend: bool, k: int) -> None:
    if blend:
        paths: list = [make_shards(tmp_path, SIZES), make_shards(tmp_path, [41, 25], first=3)]
        kw: dict[str, object] = {"weights": [0.7, 0.3]}
    else:
        paths, kw = make_shards(tmp_path, SIZES), {}
    uninterrupted = global_batches(loaders(paths, world=1, micro=2, accum=2, **kw), k + 6)
    two = loaders(paths, world=2, micro=1, accum=2, **kw)
    assert global_batches(two, k) == uninterrupted[:k]
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    assert state["consumed_samples"] == k * 4 and state["micro_in_step"] == 0
    state = json.loads(json.dumps(state))  # survives a JSON checkpoint
    (one,) = loaders(paths, world=1, micro=4, accum=1, **kw)
    one.load_state_dict(state)
    assert global_batches([one], 6) == uninterrupted[k:]


def test_resume_mid_step_needs_the_same_layout(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    (ref,) = loaders(paths, world=1, micro=2, accum=3)
    (a,) = loaders(paths, world=1, micro=2, accum=3)
    for _ in range(4):
        a.next_batch()
        ref.next_batch()
    (b,) = loaders(paths, world=1, micro=2, accum=3)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert torch.equal(b.next_batch()[0], ref.next_batch()[0])
    (c,) = loaders(paths, world=1, micro=3, accum=2)
    with pytest.raises(DataError, match="mid-step"):
        c.load_state_dict(a.state_dict())
    (d,) = loaders(paths, world=1, micro=2, accum=3, seed=5)
    with pytest.raises(DataError, match="seed"):
        d.load_state_dict(a.state_dict())
    (e,) = loaders(paths[:2], world=1, micro=2, accum=3)
    with pytest.raises(DataError, match="another dataset or block size"):
        e.load_state_dict(a.state_dict())


def test_blend_is_deterministic_with_exact_shares_and_epochs_per_dataset(tmp_path: Path) -> None:
    a = make_shards(tmp_path, [4 * 50 + 1])  # 50 samples
    b = make_shards(tmp_path, [4 * 30 + 1], first=1)  # 30 samples
    loader = loaders([a, b], world=1, micro=64, accum=1, seed=3, weights=[3, 1])[0]
    stream = [s for _ in range(BLOCK // 64) for s in sample_ids(loader.next_batch()[0])]
    from_a = [s for s in stream if s[0] == 0]
    assert len(from_a) == BLOCK * 3 // 4  # exactly the weight's share of a blend block
    for e in range(len(from_a) // 50):  # every sample of a once per epoch of a
        assert set(from_a[50 * e : 50 * (e + 1)]) == {(0, j) for j in range(50)}
    from_b = [s for s in stream if s[0] == 1]
    assert set(from_b[:30]) == {(1, j) for j in range(30)}
    fifty = loaders([a, b], world=1, micro=50, accum=1, seed=3, weights=[3, 1])[0]
    assert [s for _ in range(4) for s in sample_ids(fifty.next_batch()[0])] == stream[:200]  # any batch size
    other = loaders([a, b], world=1, micro=64, accum=1, seed=4, weights=[3, 1])[0]
    assert sample_ids(other.next_batch()[0]) != stream[:64]
    with pytest.raises(DataError, match="blend weights"):
        loaders([a, b], world=1, micro=64, accum=1, seed=3, weights=[1, 1])[0].load_state_dict(
            loader.state_dict()
        )


def test_prefetch_gives_the_same_batches_and_state(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    (plain,) = loaders(paths, world=1, micro=2, accum=2)
    (ahead,) = loaders(paths, world=1, micro=2, accum=2, prefetch=3, pin_memory=False)
    for i in range(11):
        x0, y0 = plain.next_batch()
        x1, y1 = ahead.next_batch()
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
        if i == 6:
            assert ahead.state_dict() == plain.state_dict()  # what was taken, not what was prefetched
    state = plain.state_dict()
    ahead.load_state_dict(state)  # stops the thread, restarts from the state
    (fresh,) = loaders(paths, world=1, micro=2, accum=2)
    fresh.load_state_dict(state)
    assert [torch.equal(ahead.next_batch()[0], fresh.next_batch()[0]) for _ in range(5)] == [True] * 5
    ahead.close()
    assert ahead._thread is None


def test_prefetch_hands_errors_to_the_caller(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    (loader,) = loaders(paths, world=1, micro=2, accum=1, prefetch=2, pin_memory=False)
    loader.next_batch()
    loader.shards[1] = loader.shards[1][:3]  # as if a shard vanished under the loader
    with pytest.raises(ValueError):
        for _ in range(20):
            loader.next_batch()


def test_iter_eval_is_deterministic_and_leaves_training_alone(tmp_path: Path) -> None:
    ranks = loaders(make_shards(tmp_path, SIZES), world=2, micro=2, accum=1)
    ranks[0].next_batch()
    state = ranks[0].state_dict()
    ev = [[sample_ids(x) for x, _ in r.iter_eval(3)] for r in ranks]
    merged = [s for b in range(3) for r in range(2) for s in ev[r][b]]
    assert merged == sorted(ALL_SAMPLES)[:12]
    assert ranks[0].state_dict() == state
    assert len(list(ranks[0].iter_eval(100))) == 4  # capped at the samples there are


def test_block_larger_than_a_shard(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, [40, 7])
    with pytest.raises(
        DataError, match=r"shard1\.bin: 7 tokens, shorter than one sample of block_size \+ 1 = 9"
    ):
        ShardedLoader(paths, block_size=8, micro_batch_size=1, grad_accum=1, rank=0, world_size=1, seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory is only used with CUDA; no GPU here")
def test_prefetched_batches_are_pinned_on_cuda(tmp_path: Path) -> None:
    (loader,) = loaders(make_shards(tmp_path, SIZES), world=1, micro=2, accum=1, prefetch=2)
    assert loader.pin_memory
    x, y = loader.next_batch()
    assert x.is_pinned() and y.is_pinned()
    assert torch.equal(x.to("cuda", non_blocking=True).cpu(), x)
    loader.close()


def test_no_pinned_memory_without_cuda(tmp_path: Path) -> None:
    (loader,) = loaders(make_shards(tmp_path, SIZES), world=1, micro=2, accum=1, prefetch=2)
    assert loader.pin_memory == torch.cuda.is_available()
    loader.close()


def test_a_dropped_loader_stops_its_thread(tmp_path: Path) -> None:
    import gc
    import threading

    (loader,) = loaders(make_shards(tmp_path, SIZES), world=1, micro=2, accum=1, prefetch=2)
    loader.next_batch()
    thread = loader._thread
    assert thread is not None and thread.is_alive()
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive() and threading.active_count() >= 1
