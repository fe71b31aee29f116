"""The bytes of a checkpoint (training/checkpoint/files.py): files written without the zip CRC and
hashed beside the writing, verified in parallel, older sha256 manifests still verified, the snapshot a
background save writes from, and background saves in the 2-rank job: the same bytes as synchronous
ones, and a stop that waits for the save in flight."""

from __future__ import annotations

import collections
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from pretrain.errors import CheckpointError
from pretrain.training.checkpoint import store as checkpoint
from pretrain.training.checkpoint.files import (
    Background,
    describe,
    snapshot,
    tensor_bytes,
    without_zip_crc,
)
from tests.conftest import ckpt


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    with without_zip_crc():
        torch.save(obj, buf)
    return buf.getvalue()


def test_a_snapshot_writes_the_bytes_the_originals_would_and_keeps_them():
    """Views of one storage stay views of one copy (DeepSpeed's flat buffers, a tied embedding), a
    module state dict keeps its type and `_metadata`, a Parameter stays one; training changing the
    originals afterwards leaves the snapshot as it was."""
    flat = torch.arange(12.0)
    sd = collections.OrderedDict(
        a=flat[:4], b=flat[4:].view(2, 4), tied=flat[:4], n=3, p=torch.nn.Parameter(torch.ones(3))
    )
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"module": sd, "optimizer": {"state": {0: {"exp_avg": torch.zeros(5)}}, "param_groups": [{"lr": 0.1}]},
             "rng": [torch.get_rng_state()], "shapes": (torch.Size([2, 4]),)}  # fmt: skip
    before = _saved(state)
    snap = snapshot(state)
    assert _saved(snap) == before
    assert type(snap["module"]) is collections.OrderedDict and snap["module"]._metadata == {
        "": {"version": 1}
    }
    assert isinstance(snap["module"]["p"], torch.nn.Parameter)
    assert (
        snap["module"]["a"].untyped_storage().data_ptr() == snap["module"]["b"].untyped_storage().data_ptr()
    )
    flat.add_(100.0)  # the step goes on
    state["optimizer"]["state"][0]["exp_avg"].fill_(7.0)
    assert _saved(snap) == before != _saved(state)
    assert tensor_bytes(state) == 12 * 4 + 3 * 4 + 5 * 4 + torch.get_rng_state().numel()  # shared once


def test_files_without_the_zip_crc_load_and_the_setting_comes_back():
    from torch.utils.serialization import config

    data = _saved({"w": torch.arange(6.0)})
    assert config.save.compute_crc32 is True
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["w"], torch.arange(6.0))


def _fake_checkpoint(path, files: dict[str, bytes], digest: str) -> None:
    path.mkdir()
    entries = {}
    for name, data in files.items():
        (path / name).write_bytes(data)
        entries[name] = {"bytes": len(data)}
        if digest == "sha256":  # a checkpoint of an earlier version
            entries[name]["sha256"] = hashlib.sha256(data).hexdigest()
        else:
            entries[name].update(describe(path / name, True))
    meta = {"step": 1, "loader": {}, "config": {}, "tokens_seen": 0, "files": entries}
    (path / checkpoint.META).write_text(json.dumps(checkpoint.seal(meta)))


@pytest.mark.parametrize("digest", ["blake3", "sha256"])
def test_verify_checks_every_file_of_either_digest_on_threads(tmp_path, digest):
    files = {f"f{i}.pt": bytes([i]) * (1000 + i) for i in range(5)} | {"empty": b""}
    path = tmp_path / "step_00000001"
    _fake_checkpoint(path, files, digest)
    meta = checkpoint.read_meta(path)
    assert all(digest in e for e in meta["files"].values())
    assert checkpoint.verify(path) == []
    # shared out over 2 ranks: each checks its own, together all
    assert checkpoint.verify(path, rank=0, world=2) == checkpoint.verify(path, rank=1, world=2) == []
    data = bytearray((path / "f3.pt").read_bytes())
    data[10] ^= 1  # same size, one bit
    (path / "f3.pt").write_bytes(bytes(data))
    (path / "f1.pt").write_bytes(b"short")
    assert checkpoint.verify(path) == [
        "f1.pt: 5 bytes, expected 1001",
        f"f3.pt: {digest} differs from the one recorded at save",
    ]
    assert checkpoint.verify(path, checksums=False) == ["f1.pt: 5 bytes, expected 1001"]
    (path / "f4.pt").unlink()
    assert "f4.pt: No such file or directory" in checkpoint.verify(path)


def test_deepspeeds_checkpoint_engine_interface_is_the_one_ours_implements():
    """Every method of DeepSpeed's CheckpointEngine, as checked on 0.19.8: one more, and
    RecordingEngine must say what it does with it; the abstract ones are all implemented."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    methods = {n for n, v in vars(CheckpointEngine).items() if callable(v) and not n.startswith("__")}
    assert methods == {"create", "save", "makedirs", "load", "commit", "is_data_parallel_writer",
                       "is_decoupled", "set_commit_info", "get_commit_info", "cleanup",
                       "preserves_storage_sharing"}  # fmt: skip
    cls = checkpoint.recording_engine_class()
    assert issubclass(cls, CheckpointEngine) and not cls.__abstractmethods__


def test_the_recording_engine_writes_records_and_loads(tmp_path):
    """Through DeepSpeed's interface, as its engine calls it: a file written at once and one captured
    (written by `write_all`), each recorded with its size and digest and loaded back through
    DeepSpeed's TorchCheckpointEngine; a directory or file that cannot be made is recorded, not raised."""
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo, TorchCheckpointEngine

    engine = checkpoint.recording_engine_class()(TorchCheckpointEngine())
    rec = engine.recorder
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False)
    rec.reset(checksums=True, capture=False)
    engine.create(info)
    engine.makedirs(str(tmp_path / "t"), exist_ok=True)
    engine.save({"w": torch.arange(4.0)}, str(tmp_path / "t" / "a.pt"))
    rec.capture = True
    w = torch.ones(3)
    engine.save({"w": w}, str(tmp_path / "t" / "b.pt"))
    w.add_(1.0)  # the step goes on: the captured copy is what is written
    assert engine.commit(info) is True and not engine.is_decoupled() and engine.preserves_storage_sharing()
    assert not (tmp_path / "t" / "b.pt").exists()
    written, errors = rec.write_all()
    assert errors == [] and sorted(Path(p).name for p in written) == ["a.pt", "b.pt"]
    for path, entry in written.items():
        assert entry == describe(Path(path), True)
    assert torch.equal(engine.load(str(tmp_path / "t" / "b.pt"))["w"], torch.ones(3))

    (tmp_path / "file").write_bytes(b"")
    rec.reset(checksums=True, capture=False)
    engine.makedirs(str(tmp_path / "file" / "t"), exist_ok=True)  # under a file: NotADirectoryError
    engine.save({"w": w}, str(tmp_path / "file" / "t" / "a.pt"))
    written, errors = rec.write_all()
    assert written == {} and len(errors) == 1 and "Not a directory" in errors[0]
    rec.reset(checksums=True, capture=False)
    engine.save({"w": w}, str(tmp_path / "missing" / "a.pt"))
    assert len(rec.write_all()[1]) == 1


def test_a_background_failure_is_raised_by_the_next_wait():
    bg = Background()
    bg.start(lambda: None, "ok")
    bg.wait()

    def fail() -> None:
        raise CheckpointError("saving checkpoint step_00000002 failed")

    bg.start(fail, "bad")
    with pytest.raises(CheckpointError, match="step_00000002 failed"):
        bg.wait()
    bg.wait()  # raised once


def _tensors(x: object, where: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a loaded checkpoint file, by its path."""
    if isinstance(x, torch.Tensor):
        return {where: x}
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list | tuple) else []
    return {k: v for key, val in items for k, v in _tensors(val, f"{where}/{key}").items()}


@pytest.mark.distributed
def test_background_saves_hold_what_synchronous_ones_hold(two_ranks):
    """z2_full saves at steps 3 and 6 in the background, z2_sync the same run synchronously: every
    file holds the same tensors (the weights, each rank's optimizer partition, the RNG states). Not
    the same bytes: DeepSpeed's config in them names each run's own directory (the snapshot's bytes
    are test_a_snapshot_writes_the_bytes_the_originals_would_and_keeps_them's)."""
    res, out = two_ranks
    assert res["z2_sync"]["losses"] == res["z2_full"]["losses"]
    for step in (3, 6):
        bg, sync = ckpt(out, "z2_full", step), ckpt(out, "z2_sync", step)
        files = checkpoint.read_meta(bg)["files"]
        assert files.keys() == checkpoint.read_meta(sync)["files"].keys()
        assert all("blake3" in e for e in files.values())
        for name in (f for f in files if f.endswith(".pt")):
            a, b = _tensors(checkpoint.load_file(bg / name)), _tensors(checkpoint.load_file(sync / name))
            assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), name
    stdout = res["_stdout"]
    assert f"saving checkpoint {ckpt(out, 'z2_full', 3)} in the background" in stdout
    assert f"saved checkpoint {ckpt(out, 'z2_full', 3)} (written in the background" in stdout
    assert f"saved checkpoint {ckpt(out, 'z2_sync', 3)}\n" in stdout


@pytest.mark.distributed
def test_a_stop_waits_for_the_save_in_flight(two_ranks):
    """z2_stop: step 3's save is written in the background on a slow filesystem (0.5 s a file) when
    SIGTERM stops the run after step 5: the stop waits for it, then saves step 5, and both are
    committed and sound (test_resume_is_bit_exact_at_zero_2_and_3 resumes from step 5)."""
    res, out = two_ranks
    stdout = res["_stdout"]
    assert "step 5: waiting for the checkpoint save in flight" in stdout
    waited = stdout.index("step 5: waiting for the checkpoint save in flight")
    assert stdout.index(f"saved checkpoint {ckpt(out, 'z2_res', 3)} (written in the background") > waited
    assert res["z2_stop"]["stopped_by"] == "SIGTERM"
    for step in (3, 5):
        assert checkpoint.verify(ckpt(out, "z2_res", step)) == []
