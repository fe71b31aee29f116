"""Local staging of shards (loader.cache_dir): verified copies, reused across runs, bit-identical
batches, corruption and leftovers handled, a size bound that evicts or falls back, a full disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pretrain.config.tree import DataConfig, validate
from pretrain.data.dataset import Dataset, load_manifest
from pretrain.data.fingerprint import output_config
from pretrain.data.loader import ShardedLoader
from pretrain.data.shards import HEADER_SIZE, write_shard
from pretrain.data.staging import MARKER, Staged, dataset_key, stage_datasets
from pretrain.errors import ConfigError, DataError

GB = 1e9


def fake_dataset(root: Path, name: str, sizes: list[int]) -> Dataset:
    """A dataset of train shards of `sizes` tokens, distinct from any other name's (val: the first)."""
    d = root / name
    d.mkdir()
    entries = []
    seed = sum(name.encode())
    for k, n in enumerate(sizes):
        tokens = (np.arange(n) * 7 + seed + k).astype(np.uint16) % 500
        info = write_shard(d / f"train_{k:05d}.bin", tokens.astype(np.uint16), n_docs=1)
        entries.append(
            {"path": info.path.name, "n_tokens": info.n_tokens, "n_docs": 1, "sha256": info.sha256}
        )
    return Dataset(d, {"train": entries, "val": entries[:1]})


def stage(
    ds: list[Dataset],
    cache: Path,
    *,
    max_gb: float = 1.0,
    verify: bool = False,
    warn: Callable[[str], None] | None = None,
) -> Staged:
    if warn is None:  # the default: one line on stderr
        return stage_datasets(ds, "train", cache_dir=cache, max_gb=max_gb, verify=verify)
    return stage_datasets(ds, "train", cache_dir=cache, max_gb=max_gb, verify=verify, warn=warn)


def test_staging_copies_verifies_and_the_next_run_reuses(char_dataset: Path, tmp_path: Path) -> None:
    ds = Dataset(char_dataset, load_manifest(char_dataset))
    cache = tmp_path / "nvme"
    first = stage([ds], cache)
    copies = first.paths[0]
    assert [p.parent for p in copies] == [cache / dataset_key(ds)] * len(copies)
    assert (first.staged, first.reused, first.in_place) == (len(copies), 0, 0)
    assert first.copied_bytes == sum(p.stat().st_size for p in ds.shard_paths("train"))
    for src, copy in zip(ds.shard_paths("train"), copies, strict=True):
        assert copy.read_bytes() == src.read_bytes() and copy.with_name(copy.name + MARKER).is_file()
    inodes = [p.stat().st_ino for p in copies]

    again = stage([ds], cache, verify=True)  # verify: hashed again, still the same files
    assert (again.staged, again.reused) == (0, len(copies))
    assert again.paths[0] == copies and [p.stat().st_ino for p in copies] == inodes
    assert "0 staged (0 B copied), 1 reused, 0 read in place" in again.summary(cache, "train")


def test_batches_are_bit_identical_with_and_without_the_cache(char_dataset: Path, tmp_path: Path) -> None:
    ds = Dataset(char_dataset, load_manifest(char_dataset))
    staged = stage([ds], tmp_path / "nvme")
    kw: dict[str, Any] = {
        "block_size": 64,
        "micro_batch_size": 4,
        "grad_accum": 2,
        "rank": 0,
        "world_size": 1,
    }
    plain, cached = (
        ShardedLoader([ds.shard_paths("train")], seed=3, **kw),
        ShardedLoader(staged.paths, seed=3, **kw),
    )
    assert cached.paths != plain.paths
    for _ in range(6):
        (x0, y0), (x1, y1) = plain.next_batch(), cached.next_batch()
        assert x0.equal(x1) and y0.equal(y1)
    assert plain.state_dict() == cached.state_dict()


def test_a_changed_copy_is_copied_again_and_silent_rot_is_refused(tmp_path: Path) -> None:
    ds = fake_dataset(tmp_path, "a", [3000])
    cache = tmp_path / "nvme"
    copy = stage([ds], cache).paths[0][0]
    source = ds.shard_paths("train")[0]

    with open(copy, "r+b") as f:  # written to: its mtime moves, the marker no longer agrees
        f.seek(HEADER_SIZE)
        f.write(b"\xff\xff")
    again = stage([ds], cache)
    assert again.staged == 1 and copy.read_bytes() == source.read_bytes()

    st = copy.stat()  # a bit flipped behind the file system's back: same size, mtime, inode
    with open(copy, "r+b") as f:
        f.seek(HEADER_SIZE + 10)
        f.write(b"\x01")
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stage([ds], cache).reused == 1  # without loader.verify_shards only the stat is checked
    with pytest.raises(
        DataError, match=r"no longer matches its sha256.*removed now, start the run again"
    ) as e:
        stage([ds], cache, verify=True)
    assert "; " not in str(e.value) and not copy.exists()
    assert stage([ds], cache, verify=True).staged == 1 and copy.read_bytes() == source.read_bytes()


def test_a_killed_copys_leftovers_are_ignored_and_removed(tmp_path: Path) -> None:
    ds = fake_dataset(tmp_path, "a", [3000, 3000])
    cache = tmp_path / "nvme"
    key_dir = cache / dataset_key(ds)
    key_dir.mkdir(parents=True)
    (key_dir / "train_00000.bin.tmp-999999").write_bytes(b"PRTSHARD half a copy")
    (key_dir / "train_00001.bin.ok.tmp-999999").write_text("{")
    staged = stage([ds], cache)
    assert staged.staged == 2
    assert sorted(p.name for p in key_dir.iterdir()) == [
        "train_00000.bin",
        "train_00000.bin.ok",
        "train_00001.bin",
        "train_00001.bin.ok",
    ]


def test_ranks_staging_at_once_copy_each_shard_once(tmp_path: Path) -> None:
    ds = fake_dataset(tmp_path, "a", [20_000, 20_000])
    cache = tmp_path / "nvme"
    results: list[Staged] = []
    threads = [threading.Thread(target=lambda: results.append(stage([ds], cache))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.staged for r in results) == 2 and sum(r.reused for r in results) == 6
    assert all(r.paths == results[0].paths for r in results)


def test_the_bound_evicts_the_least_recently_used_other_dataset_or_reads_in_place(tmp_path: Path) -> None:
    a, b = fake_dataset(tmp_path, "a", [10_000, 10_000]), fake_dataset(tmp_path, "b", [10_000, 10_000])
    cache = tmp_path / "nvme"
    a0, a1 = stage([a], cache).paths[0]  # 2 x 20,064 bytes
    os.utime(a0.with_name(a0.name + MARKER), (2e9, 2e9))  # a0 used last
    os.utime(a1.with_name(a1.name + MARKER), (1e9, 1e9))

    staged = stage([b], cache, max_gb=70_000 / GB)  # room for three shards: a1 goes
    assert staged.staged == 2 and a0.exists() and not a1.exists()
    assert not a1.with_name(a1.name + MARKER).exists()

    warnings: list[str] = []
    big = fake_dataset(tmp_path, "big", [40_000])  # 80 KB: more than the whole bound
    staged = stage([big], cache, max_gb=70_000 / GB, warn=warnings.append)
    assert staged.in_place == 1 and staged.paths == [big.shard_paths("train")]
    assert a0.exists(), "nothing is evicted for a shard that cannot fit anyway"
    (line,) = warnings
    assert str(big.shard_paths("train")[0]) in line and str(cache) in line
    assert "raise loader.cache_max_gb, or free space there" in line and "; " not in line

    # a blend's own datasets are never evicted for each other: the second reads in place
    staged = stage([a, b], cache, max_gb=70_000 / GB, warn=warnings.append)
    assert all(p.exists() for g in staged.paths for p in g) and staged.in_place == 1


MOUNT_AND_RUN = (
    'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -c "$3"'  # in a mount namespace of its own
)


@pytest.mark.skipif(
    shutil.which("unshare") is None,
    reason="needs the system package util-linux (unshare) to mount a small tmpfs",
)
def test_a_full_disk_reads_in_place_and_leaves_no_partial_copy(tmp_path: Path) -> None:
    ds = fake_dataset(tmp_path, "a", [3000, 60_000])  # 6 KB fits the 64 KB disk, 120 KB does not
    (tmp_path / "ds.json").write_text(json.dumps({"dir": str(ds.dir), "manifest": ds.manifest}))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    script = (
        "import json, sys\nfrom pathlib import Path\nfrom pretrain.data.dataset import Dataset\n"
        "from pretrain.data.staging import stage_datasets\n"
        f"d = json.loads(Path({str(tmp_path / 'ds.json')!r}).read_text())\n"
        f"s = stage_datasets([Dataset(Path(d['dir']), d['manifest'])], 'train', cache_dir={str(nvme)!r}, "
        "max_gb=1.0, verify=False)\n"
        f"print(json.dumps([s.staged, s.in_place, [str(p) for p in s.paths[0]], sorted(p.name for p in "
        f"Path({str(nvme)!r}).glob('*/*'))]))\n"
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", MOUNT_AND_RUN, "-", str(nvme), sys.executable, script],
        capture_output=True,
        text=True,
        check=False,
    )
    if "mount" in out.stderr and out.returncode:
        pytest.skip(f"needs root (or user namespaces) to mount a small tmpfs: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    staged, in_place, paths, files = json.loads(out.stdout)
    assert (staged, in_place) == (1, 1) and paths[1] == str(ds.shard_paths("train")[1])
    assert files == ["train_00000.bin", "train_00000.bin.ok"]
    (line,) = out.stderr.strip().splitlines()
    assert "train_00001.bin: read in place" in line and "is full" in line and "; " not in line


def test_cache_dir_is_refused_on_a_dataset_or_where_it_cannot_be_made(tmp_path: Path) -> None:
    data = tmp_path / "data" / "ds"
    for cache_dir, word in ((data, "is"), (data / "cache", "lies in"), (tmp_path / "data", "holds")):
        with pytest.raises(ConfigError, match=f"loader.cache_dir {cache_dir} {word} the dataset") as e:
            validate({"data": {"dataset_dir": str(data)}, "loader": {"cache_dir": str(cache_dir)}})
        assert "point loader.cache_dir at a node-local directory of its own" in str(e.value)
    cached = validate({"data": {"dataset_dir": str(data)}, "loader": {"cache_dir": str(tmp_path / "nvme")}})
    assert output_config(cached.data) == output_config(DataConfig(dataset_dir=str(data))), "the same dataset"

    (tmp_path / "a-file").write_text("")
    ds = fake_dataset(tmp_path, "a", [3000])
    with pytest.raises(DataError, match=r"cannot create it .* point loader.cache_dir at a writable") as err:
        stage([ds], tmp_path / "a-file" / "cache")
    assert "; " not in str(err.value)
