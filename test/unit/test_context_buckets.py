"""The default context-encoding buckets of ``minimax-m3 compile`` and the neuron engine (pure Python, no SDK):
powers of two from 128 below the context length, then the context length itself, written out by hand."""

import pytest

from minimax_m3.engine.spec import _ints, context_buckets


@pytest.mark.parametrize("ctx,want", [
    (8192, [128, 256, 512, 1024, 2048, 4096, 8192]),
    (3008, [128, 256, 512, 1024, 2048, 3008]),
    (256, [128, 256]),
    (128, [128]),
    (80, [80]),  # below the smallest bucket: one bucket, the context length
    (32768, [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]),
])
def test_default_context_buckets_by_hand(ctx, want):
    assert context_buckets(ctx) == want


def test_an_explicit_list_wins_and_is_sorted():
    assert _ints("8192, 1024,1024") == (1024, 8192)
