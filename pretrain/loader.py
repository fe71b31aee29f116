"""The training data loader: fixed windows of token shards, in an order that can be resumed.

A sample is a window of block_size + 1 tokens starting at a multiple of block_size in one
shard (windows never cross shards): x is its first block_size tokens, y the last. An epoch's
order of samples is `default_rng((seed, epoch)).permutation(n_samples)`, cut into global
batches of micro_batch_size × grad_accum × world_size samples (one optimizer step). Rank r takes
the r-th contiguous slice of each global batch and yields it as grad_accum micro batches.

So the global batches depend only on (seed, samples consumed), never on the world size: a run
saved at a step boundary on 2 ranks resumes on 1 or 4 ranks with the same data, as long as the
global batch size is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.corpus import DataError
from pretrain.shards import open_shard

_STATE_KEYS = (
    "consumed_samples",
    "epoch",
    "seed",
    "micro_in_step",
    "position",
    "n_samples",
    "micro_batch_size",
    "grad_accum",
    "world_size",
)


class ShardedLoader:
    def __init__(
        self,
        shard_paths: list[Path],
        block_size: int,
        micro_batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        verify: bool = True,
    ) -> None:
        for name, value in (("block_size", block_size), ("micro_batch_size", micro_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if grad_accum < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need grad_accum >= 1 and 0 <= rank < world_size, got {grad_accum}, {rank}, {world_size}"
            )
        if not shard_paths:
            raise DataError("no shards given to the loader")
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.paths = [Path(p) for p in shard_paths]
        self.shards = [open_shard(p, verify=verify) for p in self.paths]

        windows = [(len(s) - 1) // block_size for s in self.shards]
        # Sample i lives in shard k where starts[k] <= i < starts[k + 1].
        self._starts = np.cumsum([0, *windows])
        self.n_samples = int(self._starts[-1])
        if self.n_samples == 0:
            sizes = ", ".join(f"{p} ({len(s)} tokens)" for p, s in zip(self.paths, self.shards, strict=True))
            raise DataError(
                f"block_size {block_size} needs shards of at least {block_size + 1} tokens, but every shard is "
                f"shorter: {sizes}"
            )
        self.rank_batch_size = micro_batch_size * grad_accum
        self.global_batch_size = self.rank_batch_size * world_size
        if self.n_samples < self.global_batch_size:
            raise DataError(
                f"{self.paths[0]}{' …' if len(self.paths) > 1 else ''}: {self.n_samples} samples of "
                f"{block_size + 1} tokens, fewer than one global batch of {self.global_batch_size}"
            )

        # The position: `epoch`, the offset `position` of the current global batch in that
        # epoch's order, and the micro batches of it this rank has already yielded.
        self.epoch = 0
        self.position = 0
        self.micro_in_step = 0
        self.consumed_samples = 0  # all ranks, all epochs; counts micro steps as they complete
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)
        self._rank_slice = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.global_batch_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng((self.seed, epoch)).permutation(self.n_samples)
            else:
                self._order = np.arange(self.n_samples)
            self._order_epoch = epoch
        return self._order

    def _batch(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        shard_of = np.searchsorted(self._starts, samples, side="right") - 1
        windows = np.empty((len(samples), self.block_size + 1), dtype=np.int64)
        for row, (i, k) in enumerate(zip(samples.tolist(), shard_of.tolist(), strict=True)):
            start = (i - int(self._starts[k])) * self.block_size
            windows[row] = self.shards[k][start : start + self.block_size + 1]
        w = torch.from_numpy(windows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T) each

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro batch: (x, y), int64, shape (micro_batch_size, block_size)."""
        if self.micro_in_step == 0:
            # Epoch boundary: the samples left over after the last whole global batch are
            # dropped, and the next epoch starts with a new order.
            if self.position + self.global_batch_size > self.n_samples:
                self.epoch += 1
                self.position = 0
            lo = self.position + self.rank * self.rank_batch_size
            self._rank_slice = self._epoch_order(self.epoch)[lo : lo + self.rank_batch_size]
        m = self.micro_batch_size
        x, y = self._batch(self._rank_slice[self.micro_in_step * m : (self.micro_in_step + 1) * m])
        self.micro_in_step += 1
        self.consumed_samples += m * self.world_size
        if self.micro_in_step == self.grad_accum:
            self.micro_in_step = 0
            self.position += self.global_batch_size
        return x, y

    def state_dict(self) -> dict[str, Any]:
        """The data position. Saved at an optimizer-step boundary (micro_in_step 0) it resumes the
        same global batches on any world size with the same global batch size; saved mid-step,
        only with the same micro batch size, accumulation and world size.

        consumed_samples counts samples of all ranks and epochs as micro steps complete;
        (epoch, position) is where the current global batch starts in that epoch's order."""
        return {
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "seed": self.seed,
            "micro_in_step": self.micro_in_step,
            "position": self.position,
            "n_samples": self.n_samples,
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
        if state["n_samples"] != self.n_samples:
            raise DataError(
                f"loader state is for {state['n_samples']} samples, these shards with block_size "
                f"{self.block_size} give {self.n_samples}: another dataset or block size"
            )
        micro = int(state["micro_in_step"])
        layout = (state["micro_batch_size"], state["grad_accum"], state["world_size"])
        if micro and layout != (self.micro_batch_size, self.grad_accum, self.world_size):
            raise DataError(
                f"loader state was saved mid-step (after micro batch {micro}); resuming it needs the same "
                f"micro_batch_size, grad_accum and world_size {layout}, this run has "
                f"{(self.micro_batch_size, self.grad_accum, self.world_size)}"
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.micro_in_step = micro
        self._rank_slice = np.empty(0, dtype=np.int64)
        if micro:
            lo = self.position + self.rank * self.rank_batch_size
            self._rank_slice = self._epoch_order(self.epoch)[lo : lo + self.rank_batch_size]

    def iter_eval(self, n_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches of an unshuffled pass over the first
        n_batches × micro_batch_size × world_size samples. Every rank yields the same number of
        batches (fewer than n_batches if the shards are short). The training position is untouched."""
        per_batch = self.micro_batch_size * self.world_size
        n = min(n_batches, self.n_samples // per_batch)
        for b in range(n):
            lo = b * per_batch + self.rank * self.micro_batch_size
            yield self._batch(np.arange(lo, lo + self.micro_batch_size))
