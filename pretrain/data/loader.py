"""The training data loader: fixed windows of token shards, in an order that survives any resume.

A sample is a window of block_size + 1 tokens starting at a multiple of block_size in one shard
(windows never cross shards): x is its first block_size tokens, y the last. Every shard is
memory-mapped; nothing is read ahead of need but the micro batches being prefetched.

The order is one endless stream of samples, a pure function of (seed, position):
- one dataset: stream position p is sample `perm_{seed, epoch}(p mod n)` of epoch p // n, where
  perm is a pseudorandom permutation evaluated blockwise (a Feistel network, no n-sized array);
  so each sample appears exactly once per epoch of n positions;
- a blend of datasets with weights: the stream is cut into blocks of 65536 positions, each
  holding every dataset's share (weights × 65536, rounded) in a shuffled arrangement of its own,
  and dataset d's k-th position takes its k-th sample as above. Exact shares, and still a pure
  function of the position;
- a scheduled mix (config/mix.py): block b's shares are the weights at its first token
  (b x 65536 x block_size), so they vary block by block. Dataset d's positions before block b are
  then a running sum over the blocks, summed a chunk of blocks at a time and cached (O(blocks), and
  constant per block once the last point of the schedule is passed).

Global batches are consecutive runs of micro_batch_size × grad_accum × world_size positions (one
optimizer step). Rank r takes the r-th contiguous slice of each and yields it as grad_accum
micro batches. The state is the number of global samples consumed, so a run saved at a step
boundary on 2 ranks resumes on 1 or 4 ranks with the same global batches.

With prefetch > 0 a background thread prepares the next micro batches (in pinned memory when CUDA
is present) while the step runs; the state still counts only what the caller has taken.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.config.mix import (
    BLEND_BLOCK,
    Weight,
    blend_problems,
    is_scheduled,
    read_weight,
    weight_problems,
)
from pretrain.data.shards import open_shard
from pretrain.errors import DataError

BLOCK = BLEND_BLOCK  # positions per blend block and per cached permutation block
_CHUNK = 4096  # blend blocks whose shares a scheduled mix sums at once
_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_STATE_KEYS = ("consumed_samples", "position", "micro_in_step", "seed", "n_samples", "weights")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping multiplication is intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A pseudorandom permutation of range(n), evaluated at any indices without materializing it:
    a Feistel network on the smallest even-bit domain ≥ n, cycle-walked back into range."""

    def __init__(self, n: int, key: Sequence[int]) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = np.random.default_rng(list(key)).integers(0, 1 << 62, size=_ROUNDS).astype(np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << self._half) | right

    def __call__(self, i: np.ndarray) -> np.ndarray:
        i = np.asarray(i, dtype=np.int64)
        if i.size and (i.min() < 0 or i.max() >= self.n):
            raise ValueError(f"indices must be in [0, {self.n})")
        out = self._feistel(i.astype(np.uint64))
        out_of_range = np.flatnonzero(out >= self.n)
        while out_of_range.size:  # the domain is under 4n, so this ends fast
            out[out_of_range] = self._feistel(out[out_of_range])
            out_of_range = out_of_range[out[out_of_range] >= self.n]
        return out.astype(np.int64)


@dataclass(frozen=True)
class _Cursor:
    """Where the stream is: `position` global samples in completed steps, plus the micro
    batches of the current step this rank has produced."""

    position: int
    micro: int


class _Cache:
    """A few recent blocks (of permutations or blend arrangements), least recently used out."""

    def __init__(self, size: int = 8) -> None:
        self._d: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._size = size

    def get(self, key: tuple[int, ...], make: Any) -> Any:
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        value = self._d[key] = make()
        if len(self._d) > self._size:
            self._d.popitem(last=False)
        return value


def _check_layout(
    *, block_size: int, micro_batch_size: int, grad_accum: int, rank: int, world_size: int, prefetch: int
) -> None:
    for name, value in (("block_size", block_size), ("micro_batch_size", micro_batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if grad_accum < 1 or world_size < 1 or not 0 <= rank < world_size or prefetch < 0:
        raise ValueError(
            f"need grad_accum >= 1, 0 <= rank < world_size, prefetch >= 0; got {grad_accum}, {rank}, "
            f"{world_size}, {prefetch}"
        )


def _dataset_groups(shard_paths: Sequence[str | Path] | Sequence[Sequence[str | Path]]) -> list[list[Path]]:
    """One list of shard paths per dataset (a single dataset given as a flat list)."""
    if not shard_paths:
        raise DataError("no shards given to the loader")
    return (
        [[Path(p) for p in shard_paths]]  # type: ignore[arg-type]
        if isinstance(shard_paths[0], str | Path)
        else [[Path(p) for p in g] for g in shard_paths]  # type: ignore[union-attr]
    )


def _blend_weights(weights: Sequence[Weight] | None, groups: list[list[Path]]) -> list[Weight]:
    """One weight per dataset, fixed (a float) or a schedule (a list of (tokens, weight) points)."""
    out: list[Weight] = [1.0] * len(groups) if weights is None else [read_weight(w) for w in weights]
    problems = [p for w in out for p in weight_problems(w)] or blend_problems(out)
    if len(out) != len(groups) or problems:
        raise ValueError(f"need one weight per dataset ({len(groups)}), got {out}: {', '.join(problems)}")
    if any(not g for g in groups):
        raise DataError("a blended dataset has no shards")
    return out


def _apportion(weights: Sequence[float]) -> np.ndarray:
    """Each dataset's positions in a blend block: weights x BLOCK, largest remainders rounded up."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    exact = w * BLOCK
    shares = np.floor(exact).astype(np.int64)
    for d in np.argsort(-(exact - shares), kind="stable")[: BLOCK - int(shares.sum())]:
        shares[d] += 1
    if (shares == 0).any():
        raise ValueError(f"blend weights {list(weights)}: each share must be at least 1/{BLOCK}")
    return shares


class _Mix:
    """Each dataset's positions in blend block b (`shares(b)`) and in all the blocks before it
    (`before(b)`): the same in every block for fixed weights, else the schedule at each block's
    first token, apportioned by largest remainders as `_apportion` does. Thread-safe: the
    prefetching thread and the caller's (state_dict) both ask."""

    def __init__(self, weights: list[Weight], block_size: int) -> None:
        self.scheduled = is_scheduled(weights)
        if not self.scheduled:
            self._fixed = _apportion([float(w) for w in weights if not isinstance(w, list)])
            return
        self.tokens_per_block = BLOCK * block_size
        points = [w if isinstance(w, list) else [(0.0, float(w))] for w in weights]
        self._ts = [np.array([t for t, _ in p]) for p in points]
        self._ws = [np.array([w for _, w in p]) for p in points]
        last = max(float(ts[-1]) for ts in self._ts)
        self.flat_from = -(-int(last) // self.tokens_per_block)  # from this block on, one mix
        self._totals = [np.zeros(len(weights), dtype=np.int64)]  # before block c x _CHUNK, c = 0, 1, ...
        self._chunks = _Cache(4)
        self._lock = threading.Lock()

    def block_shares(self, blocks: np.ndarray) -> np.ndarray:
        """(len(blocks), datasets): each dataset's positions in each of these blend blocks."""
        t = np.minimum(blocks, self.flat_from).astype(np.float64) * self.tokens_per_block
        w = np.stack([_interp(ts, ws, t) for ts, ws in zip(self._ts, self._ws, strict=True)], axis=1)
        exact = w / w.sum(axis=1, keepdims=True) * BLOCK
        shares = np.floor(exact).astype(np.int64)
        # largest remainders first, a dataset of weight 0 never (its share stays 0)
        remainder = np.where(w > 0, exact - shares, -1.0)
        rank = np.argsort(np.argsort(-remainder, axis=1, kind="stable"), axis=1, kind="stable")
        shares += rank < (BLOCK - shares.sum(axis=1))[:, None]
        return shares

    def shares(self, b: int) -> np.ndarray:
        return self._fixed if not self.scheduled else self.block_shares(np.array([b]))[0]

    def before(self, b: int) -> np.ndarray:
        """Each dataset's positions in blocks 0 .. b - 1."""
        if not self.scheduled:
            return b * self._fixed
        if b > self.flat_from:  # every block from flat_from on has the same shares
            return self.before(self.flat_from) + (b - self.flat_from) * self.shares(self.flat_from)
        c, r = divmod(b, _CHUNK)
        with self._lock:
            while len(self._totals) <= c:
                self._totals.append(self._totals[-1] + self._chunk(len(self._totals) - 1)[-1])
            return self._totals[c] + self._chunk(c)[r]

    def _chunk(self, c: int) -> np.ndarray:
        """(_CHUNK + 1, datasets): the running count within chunk c, from 0 before its first block."""

        def make() -> np.ndarray:
            shares = self.block_shares(np.arange(c * _CHUNK, (c + 1) * _CHUNK))
            return np.concatenate([np.zeros((1, shares.shape[1]), dtype=np.int64), np.cumsum(shares, axis=0)])

        return self._chunks.get((c,), make)


def _interp(ts: np.ndarray, ws: np.ndarray, t: np.ndarray) -> np.ndarray:
    """config.mix.weight_at at every t, vectorized: the same arithmetic, so the same floats."""
    i = np.searchsorted(ts, t, side="right")
    lo, hi = np.clip(i - 1, 0, len(ts) - 1), np.clip(i, 0, len(ts) - 1)
    t0, t1, w0, w1 = ts[lo], ts[hi], ws[lo], ws[hi]
    inside = (i > 0) & (i < len(ts))
    span = np.where(inside, t1 - t0, 1.0)
    return np.where(inside, w0 + (w1 - w0) * ((t - t0) / span), np.where(i == 0, ws[0], ws[-1]))


def _check_shards(paths: list[Path], shards: Sequence[np.ndarray], block_size: int) -> None:
    """One token dtype, and at least one sample in every shard."""
    if len({s.dtype for s in shards}) > 1:
        raise DataError(f"{paths[0]} …: shards of different token dtypes (another tokenizer) in one loader")
    short = [(p, len(s)) for p, s in zip(paths, shards, strict=True) if len(s) < block_size + 1]
    if short:
        (p, n), more = short[0], len(short) - 1
        raise DataError(
            f"{p}: {n} tokens, shorter than one sample of block_size + 1 = {block_size + 1} tokens"
            f"{f' (and {more} more shards)' if more else ''}; use a smaller model.block_size, or prepare "
            "with a larger data.shard_tokens"
        )


class ShardedLoader:
    def __init__(
        self,
        shard_paths: Sequence[str | Path] | Sequence[Sequence[str | Path]],
        *,
        block_size: int,
        micro_batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        verify: bool = True,
        weights: Sequence[Weight] | None = None,
        prefetch: int = 0,
        pin_memory: bool | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """shard_paths: one dataset's shards, or one list of shards per blended dataset (then
        `weights` gives each one's share of the samples: a number, or a schedule of (tokens, weight)
        points as config/mix.py reads them). With `vocab_size`, every batch is checked
        to hold only token ids below it (unverified or foreign shards; a bad id would otherwise
        crash the embedding, or on a GPU assert in its kernel)."""
        _check_layout(
            block_size=block_size,
            micro_batch_size=micro_batch_size,
            grad_accum=grad_accum,
            rank=rank,
            world_size=world_size,
            prefetch=prefetch,
        )
        groups = _dataset_groups(shard_paths)
        self.weights = _blend_weights(weights, groups)

        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.vocab_size = vocab_size
        self.paths = [p for g in groups for p in g]
        self.shards = [open_shard(p, verify=verify) for p in self.paths]
        _check_shards(self.paths, self.shards, block_size)
        self._index_samples(groups)
        self.rank_batch_size = micro_batch_size * grad_accum
        self.global_batch_size = self.rank_batch_size * world_size
        if len(groups) == 1 and self.n_samples < self.global_batch_size:
            raise DataError(
                f"{self.paths[0]}{' …' if len(self.paths) > 1 else ''}: {self.n_samples} samples of "
                f"{block_size + 1} tokens, fewer than one global batch of {self.global_batch_size}"
            )
        self._mix = _Mix(self.weights if len(groups) > 1 else [1.0], block_size)
        self.n_datasets = len(groups)

        self._cursor = _Cursor(0, 0)  # what the caller has taken
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.prefetch = prefetch
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._finalizer: weakref.finalize | None = None
        self._caches = (_Cache(), _Cache())  # (permutation blocks, blend blocks), for the producing thread

    def _index_samples(self, groups: list[list[Path]]) -> None:
        """Where each shard's and each dataset's samples start in the concatenated shards."""
        windows = [(len(s) - 1) // self.block_size for s in self.shards]
        # Global sample i lives in shard k where starts[k] <= i < starts[k + 1].
        self._starts = np.cumsum([0, *windows])
        self._starts_list = [int(s) for s in self._starts]
        per_group = np.cumsum([0, *(len(g) for g in groups)])
        self._offsets = [int(self._starts[k]) for k in per_group]  # first sample of each dataset
        self.n_samples_per_dataset = [self._offsets[d + 1] - self._offsets[d] for d in range(len(groups))]
        self.n_samples = self._offsets[-1]

    # -----------------------------------------------------------------------------------------
    # The order: stream positions -> samples

    def _blend_block(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dataset, rank among that dataset's positions) of each position of blend block b, and
        each dataset's positions before the block."""
        shares = self._mix.shares(b)
        arrangement = np.repeat(np.arange(len(shares)), shares)
        arrangement = np.random.default_rng((self.seed, 0xB1E7D, b)).permutation(arrangement)
        within = np.empty(BLOCK, dtype=np.int64)
        for d in range(len(shares)):
            at = arrangement == d
            within[at] = np.arange(int(shares[d]))
        return arrangement, within, self._mix.before(b)

    def _dataset_samples(self, d: int, k: np.ndarray) -> np.ndarray:
        """Sample ids (within dataset d) of its k-th positions: epoch k // n, permuted by block."""
        n = self.n_samples_per_dataset[d]
        epoch, pos = np.divmod(k, n)
        if not self.shuffle:
            return pos
        out = np.empty_like(pos)
        perm_cache = self._caches[0]
        for e, blk in {
            (int(e), int(b)) for e, b in zip(epoch.tolist(), (pos // BLOCK).tolist(), strict=True)
        }:
            at = (epoch == e) & (pos // BLOCK == blk)
            block = perm_cache.get(
                (d, e, blk),
                lambda d=d, e=e, blk=blk: self._permutation(d, e)(
                    np.arange(blk * BLOCK, min((blk + 1) * BLOCK, n))
                ),
            )
            out[at] = block[pos[at] - blk * BLOCK]
        return out

    def _permutation(self, d: int, epoch: int) -> Permutation:
        return Permutation(self.n_samples_per_dataset[d], (self.seed, d, epoch))

    def _run_ids(self, lo: int, m: int) -> np.ndarray:
        """sample_ids(arange(lo, lo + m)); for one dataset, within one epoch and permutation block
        (nearly always), a slice of the cached block."""
        if self.n_datasets == 1:
            n = self.n_samples
            epoch, pos = divmod(lo, n)
            blk = pos // BLOCK
            if pos + m <= min(n, (blk + 1) * BLOCK):
                if not self.shuffle:
                    return np.arange(pos, pos + m)
                block = self._caches[0].get(
                    (0, epoch, blk),
                    lambda: self._permutation(0, epoch)(np.arange(blk * BLOCK, min((blk + 1) * BLOCK, n))),
                )
                return block[pos - blk * BLOCK : pos - blk * BLOCK + m]
        return self.sample_ids(np.arange(lo, lo + m))

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global sample ids (into the concatenated shards) at these stream positions."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.n_datasets == 1:
            return self._dataset_samples(0, positions)
        out = np.empty_like(positions)
        b, o = np.divmod(positions, BLOCK)
        ds = np.empty_like(positions)
        k = np.empty_like(positions)
        for blk in np.unique(b).tolist():
            at = b == blk
            arrangement, within, before = self._caches[1].get((blk,), lambda blk=blk: self._blend_block(blk))
            ds[at] = arrangement[o[at]]
            k[at] = before[ds[at]] + within[o[at]]
        for d in np.unique(ds).tolist():
            at = ds == d
            out[at] = self._offsets[d] + self._dataset_samples(d, k[at])
        return out

    # -----------------------------------------------------------------------------------------
    # Batches

    def _gather(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t, starts, shards = self.block_size, self._starts_list, self.shards
        windows = np.empty((len(samples), t + 1), dtype=shards[0].dtype)
        for row, i in enumerate(samples.tolist()):
            k = bisect.bisect_right(starts, i) - 1
            start = (i - starts[k]) * t
            windows[row] = shards[k][start : start + t + 1]
        x = torch.from_numpy(windows[:, :-1].astype(np.int64))  # (B, T)
        y = torch.from_numpy(windows[:, 1:].astype(np.int64))  # (B, T)
        return x, y

    def _produce(self, c: _Cursor) -> tuple[torch.Tensor, torch.Tensor, _Cursor]:
        m = self.micro_batch_size
        lo = c.position + self.rank * self.rank_batch_size + c.micro * m
        x, y = self._gather(self._run_ids(lo, m))
        if self.vocab_size is not None and (top := max(int(x.max()), int(y.max()))) >= self.vocab_size:
            e = DataError(
                f"token id {top} at or beyond the vocabulary ({self.vocab_size} "
                f"ids) in the batch at sample {lo} of {', '.join(str(p) for p in self.paths[:2])}"
                f"{' ...' if len(self.paths) > 2 else ''}: the shards are damaged or from another tokenizer; "
                "prepare the dataset again (data prepare --force), and keep loader.verify_shards on"
            )
            e.collective = False  # this rank's batch
            raise e
        nxt = (
            _Cursor(c.position + self.global_batch_size, 0)
            if c.micro + 1 == self.grad_accum
            else _Cursor(c.position, c.micro + 1)
        )
        return x, y, nxt

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro batch: (x, y), int64, shape (micro_batch_size, block_size)."""
        if self.prefetch == 0:
            x, y, self._cursor = self._produce(self._cursor)
            return x, y
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()  # the thread has ended
            raise item
        x, y, self._cursor = item
        return x, y

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        # The thread holds the loader weakly: a loader dropped without close() still goes away.
        self._thread = threading.Thread(
            target=_prefetch,
            args=(weakref.ref(self), self._cursor, self._queue, self._stop),
            name="loader-prefetch",
            daemon=True,
        )
        self._thread.start()
        # A loader dropped without close() still stops its thread.
        self._finalizer = weakref.finalize(self, _stop_prefetch, self._thread, self._queue, self._stop)

    def close(self) -> None:
        """Stop the prefetching thread (it restarts on the next next_batch)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_prefetch, once
        self._thread = self._finalizer = None

    # -----------------------------------------------------------------------------------------
    # State

    @property
    def position(self) -> int:
        """Global samples (all ranks) in the optimizer steps completed: where the next step starts."""
        return self._cursor.position

    @property
    def consumed_samples(self) -> int:
        """Global samples (all ranks) taken so far, counting micro batches as they are taken."""
        return self._cursor.position + self._cursor.micro * self.micro_batch_size * self.world_size

    @property
    def micro_in_step(self) -> int:
        """Micro batches of the current optimizer step this rank has taken (0 at a step boundary)."""
        return self._cursor.micro

    @property
    def epoch(self) -> int:
        """The epoch of the first dataset's next sample (the only dataset, unless blending)."""
        return self._taken(0, self.position) // self.n_samples_per_dataset[0]

    def _taken(self, d: int, p: int) -> int:
        """How many of the first p stream positions belong to dataset d."""
        if self.n_datasets == 1:
            return p
        b, o = divmod(p, BLOCK)
        arrangement, _, before = self._blend_block(b)  # not the cache: that one is the producer's
        return int(before[d]) + int(np.count_nonzero(arrangement[:o] == d))

    def mix(self, position: int | None = None) -> list[float]:
        """Each dataset's share of the blend block at `position` (default: where the loader stands):
        the mix in force there, as realized in whole samples."""
        b = (self.position if position is None else position) // BLOCK
        return [int(s) / BLOCK for s in self._mix.shares(b)] if self.n_datasets > 1 else [1.0]

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.global_batch_size

    def state_dict(self) -> dict[str, Any]:
        """The data position. Saved at an optimizer-step boundary (micro_in_step 0) it resumes the
        same global batches on any world size; saved mid-step, only with the same micro batch size,
        accumulation and world size."""
        return {
            "consumed_samples": self.consumed_samples,
            "position": self.position,
            "micro_in_step": self.micro_in_step,
            "epoch": self.epoch,
            "seed": self.seed,
            "n_samples": list(self.n_samples_per_dataset),
            "weights": _plain(self.weights),
            "block_size": self.block_size,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.grad_accum,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"loader state lacks {', '.join(missing)}")
        if state["seed"] != self.seed:
            raise DataError(f"loader state has seed {state['seed']}, this run's data seed is {self.seed}")
        if list(state["n_samples"]) != self.n_samples_per_dataset:
            raise DataError(
                f"loader state is for {state['n_samples']} samples, these shards with block_size "
                f"{self.block_size} give {self.n_samples_per_dataset}: another dataset or block size"
            )
        changed = _weights_change(state["weights"], _plain(self.weights))
        if changed:
            raise DataError(
                f"loader state was saved with other blend weights ({changed}): the order of the samples follows "
                "the weights and their schedules, so resume with data.blend's weights as the checkpoint has them, "
                "or start a new run"
            )
        micro = int(state["micro_in_step"])
        layout = (state.get("micro_batch_size"), state.get("grad_accum"), state.get("world_size"))
        if micro and layout != (self.micro_batch_size, self.grad_accum, self.world_size):
            raise DataError(
                f"loader state was saved mid-step (after micro batch {micro}); resuming it needs the same "
                f"micro_batch_size, grad_accum and world_size {layout}, this run has "
                f"{(self.micro_batch_size, self.grad_accum, self.world_size)}"
            )
        self.close()
        self._cursor = _Cursor(int(state["position"]), micro)

    def iter_eval(self, n_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches of an unshuffled pass over the first
        n_batches × micro_batch_size × world_size samples. Every rank yields the same number of
        batches (fewer than n_batches if the shards are short). The training position is untouched."""
        per_batch = self.micro_batch_size * self.world_size
        n = min(n_batches, self.n_samples // per_batch)
        for b in range(n):
            lo = b * per_batch + self.rank * self.micro_batch_size
            yield self._gather(np.arange(lo, lo + self.micro_batch_size))


def _plain(weights: Sequence[Weight]) -> list[Any]:
    """The weights as a checkpoint keeps them: floats, and schedules as lists of [tokens, weight]."""
    return [w if not isinstance(w, list) else [[float(t), float(v)] for t, v in w] for w in weights]


def _saved_weights(saved: Any) -> list[Any] | None:
    """A loader state's weights in `_plain`'s form (None: not weights at all)."""
    try:
        return _plain([read_weight(w) for w in saved])
    except (TypeError, ValueError):
        return None


def _weights_change(saved_weights: Any, now: list[Any]) -> str | None:
    """How a loader state's weights differ from these (`_plain`'s form): the first dataset whose
    weight changed, then and now; None where they are the same."""
    saved = _saved_weights(saved_weights)
    if saved == now:
        return None
    if saved is None or len(saved) != len(now):
        return f"{saved_weights} then, {now} now"
    d = next(i for i, (a, b) in enumerate(zip(saved, now, strict=True)) if a != b)
    return f"data.blend[{d}]: {saved[d]} then, {now[d]} now"


def _prefetch(
    ref: weakref.ref[ShardedLoader], cursor: _Cursor, q: queue.Queue[Any], stop: threading.Event
) -> None:
    """The prefetching thread: produce micro batches from `cursor` on, into q, until stopped.

    It blocks in put while the queue is full, and runs at a lower CPU priority (Linux, nice +10):
    woken by each get, it would otherwise preempt the training thread on a busy core. It needs
    little CPU, and when the queue runs dry the training thread blocks and leaves it the core."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    while not stop.is_set():
        loader = ref()
        if loader is None:
            return
        item: Any
        try:
            x, y, cursor = loader._produce(cursor)
            if loader.pin_memory:
                # Page-locked, so the caller's .to(device, non_blocking=True) overlaps the copy.
                x, y = x.pin_memory(), y.pin_memory()
            item = (x, y, cursor)
        except BaseException as e:  # handed to the caller, raised by next_batch
            item = e
        del loader
        q.put(item)  # _stop_prefetch drains the queue to unblock this
        if isinstance(item, BaseException):
            return


def _stop_prefetch(thread: threading.Thread, q: queue.Queue[Any], stop: threading.Event) -> None:
    """Stop a prefetching thread: flag it, and drain its queue until it has ended."""
    stop.set()
    if thread is threading.current_thread():
        # The thread itself dropped the last reference to the loader: make room for its last put;
        # it sees the flag right after.
        with contextlib.suppress(queue.Empty):
            while True:
                q.get_nowait()
        return
    while thread.is_alive():
        with contextlib.suppress(queue.Empty):
            q.get(timeout=0.01)
