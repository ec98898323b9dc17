"""Shared fixtures. ``pytest --backend reference|neuron|neuron-cpu`` picks the engine of the shared suite."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")  # torch_xla (imported by transformers when present) stays quiet

BACKENDS = ("reference", "neuron", "neuron-cpu")


def pytest_addoption(parser):
    parser.addoption("--backend", default="reference", choices=BACKENDS,
                     help="backend the shared integration suite runs on (default: reference)")


@pytest.fixture(scope="session")
def backend(request) -> str:
    return request.config.getoption("--backend")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The tiny synthetic checkpoint in the release layout (seed 0)."""
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def hf_tiny(tiny_ckpt):
    """The independent oracle: transformers' MiniMax-M3 loaded from the same checkpoint, float32, eager."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tiny_ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def ref_engine(tiny_ckpt):
    from minimax_m3.reference.engine import ReferenceEngine

    return ReferenceEngine.from_pretrained(tiny_ckpt, device="cpu", dtype="float32", max_seq_len=1024)


def random_ids(n: int, seed: int, vocab: int = 512, low: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()
