"""Shared fixtures: the offline data under ../shared/data, and a prepared char-level dataset."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
TINY_SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
GPT2_RANKS = SHARED_DATA / "tokenizers" / "gpt2.tiktoken"

# DeepSpeed on this machine: the CPU accelerator, one BLAS thread per rank.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def require_shared_data() -> None:
    if not TINY_SHAKESPEARE.is_file():
        pytest.skip(f"offline test data not found at {SHARED_DATA} (the project's shared/data)")


@pytest.fixture(scope="session")
def char_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-shakespeare prepared char-level once per session (90/10 split, vocab 65)."""
    require_shared_data()
    from pretrain.config import DataConfig
    from pretrain.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "tinyshakespeare-char"
    return prepare(DataConfig(corpus=str(TINY_SHAKESPEARE), tokenizer="char", dataset_dir=str(out)))


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env.pop("RANK", None)
    return env
