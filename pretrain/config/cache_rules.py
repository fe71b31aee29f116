"""The rule on loader.cache_dir, the node-local copy of the shards: apart from every dataset it copies.

Its eviction removes copies under it, and its copies are named by their dataset's shard list: a cache
inside a dataset directory would be swapped away with it by the next prepare, and a dataset inside the
cache would look like a cache entry. Whether the directory can be made is a question for the node that
stages into it (data/staging.py), not for the config, which may be checked on a login node.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def cache_dir_problems(cache_dir: str | None, dataset_dirs: Sequence[Path]) -> list[str]:
    """One message per dataset directory that `cache_dir` is, lies in, or holds."""
    if cache_dir is None:
        return []
    cache = Path(cache_dir).resolve()
    problems = []
    for d in dataset_dirs:
        real = d.resolve()
        if cache == real or real in cache.parents or cache in real.parents:
            where = "is" if cache == real else "lies in" if real in cache.parents else "holds"
            problems.append(
                f"loader.cache_dir {cache_dir} {where} the dataset directory {d}: point loader.cache_dir at a "
                "node-local directory of its own (e.g. /local/nvme/pretrain-cache)"
            )
    return problems
