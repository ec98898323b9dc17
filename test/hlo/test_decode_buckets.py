"""Token-generation buckets: ``minimax-m3 compile``'s defaults, and the decode bucket NxDI picks for the inputs the
engine really passes (issue 15, item 2).

Route: the engine calls the application with one token per row and its position, no attention mask; NxDI infers
the mask (``NeuronBaseForCausalLM._infer_attention_mask``: as long as the largest position) and its
``ModelWrapper.get_target_bucket`` picks the first bucket longer than that mask. The oracle is the rule written by
hand: a step whose new token sits at position p (context c = p + 1 tokens) runs the smallest bucket >= c, and
that bucket's caches hold slot p. The application is built but never run (its forward only records its inputs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minimax_m3.config import M3Config
from test.conftest import random_ids


@pytest.mark.parametrize("seq_len,block,want", [
    (8192, 128, [128, 256, 512, 1024, 2048, 4096, 8192]),
    (6144, 128, [128, 256, 512, 1024, 2048, 4096, 6144]),
    (256, 16, [128, 256]),
    (1152, 48, [144, 288, 576, 1152]),  # block-aligned: 3 x 48 is the first multiple >= 128
    (128, 128, [128]),
])
def test_default_token_buckets_by_hand(seq_len, block, want):
    from minimax_m3.neuron.compile import token_buckets

    assert token_buckets(seq_len, block) == want


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return str(write_synthetic(tmp_path_factory.mktemp("tkg") / "tiny", M3Config.preset("tiny"), seed=0))


def _recording_engine(ckpt, **fields):
    from test.support.neuron import standins

    standins.bootstrap()
    from minimax_m3.neuron.build import inference_config
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM
    from minimax_m3.neuron.provider import NeuronEngine
    from test.support.neuron.cpu_plugin import nxdi_spec

    spec, m3 = nxdi_spec(ckpt, "neuron", tp=1, ep=1, lnc=1, **fields)  # the device layout, never run
    config = inference_config(spec, m3, save_sharded_checkpoint=False, attn_kernel_enabled=False)
    app = NeuronMiniMaxM3ForCausalLM(ckpt, config)
    calls = []

    def forward(**inputs):
        calls.append(inputs)
        n = inputs["input_ids"].shape[0]
        return SimpleNamespace(logits=torch.zeros(n, inputs["input_ids"].shape[1], config.vocab_size))

    app.forward = forward
    return NeuronEngine(app, config.m3_config()), app, calls


def _decode_bucket(app, inputs) -> tuple[int, int]:
    """(bucket NxDI runs, length of the mask it infers) for one decode call's inputs."""
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = app._infer_attention_mask(inputs["position_ids"])
    args = (inputs["input_ids"], mask, inputs["position_ids"], inputs["seq_ids"])
    return app.token_generation_model.get_target_bucket(*args), mask.shape[1]


def test_each_decode_step_runs_the_smallest_bucket_that_holds_its_context(ckpt):
    from minimax_m3.engine import GenerationConfig
    from minimax_m3.neuron.compile import token_buckets

    buckets = token_buckets(512, M3Config.preset("tiny").index_block_size)
    assert buckets == [128, 256, 512]
    eng, app, calls = _recording_engine(ckpt, max_batch=1, max_seq_len=512, max_context_len=256,
                                        token_buckets=tuple(buckets))
    assert app.token_generation_model.neuron_config.buckets == buckets
    prompt = random_ids(120, seed=3)
    steps = 150  # positions 120 .. 268: crosses 128 and 256
    eng.generate([prompt], GenerationConfig(max_new_tokens=steps + 1))
    decode = [c for c in calls if c["input_ids"].shape[1] == 1]
    assert len(decode) == steps
    seen = set()
    for inputs in decode:
        p = int(inputs["position_ids"].max())
        bucket, _ = _decode_bucket(app, inputs)
        assert bucket == min(b for b in buckets if b >= p + 1), (p, bucket)
        assert p < bucket  # the new token's slot is inside the bucket's caches
        seen.add(bucket)
    assert seen == {128, 256, 512}


def test_a_batch_decodes_in_the_bucket_of_its_longest_row(ckpt):
    eng, app, _ = _recording_engine(ckpt, max_batch=2, max_seq_len=512, max_context_len=256,
                                    token_buckets=(128, 256, 512))
    tokens = torch.tensor([[5], [6]])
    for rows, want in (([10, 127], 128), ([127, 128], 256), ([300, 3], 512), ([0, 255], 256)):
        inputs = dict(input_ids=tokens, position_ids=torch.tensor(rows).view(2, 1), seq_ids=torch.arange(2))
        assert _decode_bucket(app, inputs)[0] == want, rows


def test_token_buckets_off_the_indexer_block_are_refused_at_config_time(ckpt):
    from test.support.neuron import standins

    standins.bootstrap()
    from minimax_m3.neuron.build import inference_config
    from test.support.neuron.cpu_plugin import nxdi_spec

    block = M3Config.preset("tiny").index_block_size
    spec, m3 = nxdi_spec(ckpt, "neuron", tp=1, ep=1, lnc=1, max_batch=1, max_seq_len=512, max_context_len=256,
                         token_buckets=(120, 512))  # resolved, not validated: NxDI's own check is under test
    with pytest.raises(ValueError, match=f"token-generation buckets \\[120, 512\\] must be multiples of "
                                         f"index_block_size {block}"):
        inference_config(spec, m3, save_sharded_checkpoint=False)


def test_compile_names_off_block_token_buckets_in_one_message(tmp_path, tiny_ckpt):
    """``compile --dry-run --token-buckets 100,256``: exit 2, one message naming the buckets and the fix, no
    traceback, nothing written."""
    import os
    import subprocess
    import sys

    from test.hlo.conftest import REPO

    out = tmp_path / "out"
    args = ["--model", str(tiny_ckpt), "--tp", "1", "--ep", "1", "--lnc", "1", "--seq-len", "256",
            "--context-buckets", "128,256", "--token-buckets", "100,256", "--compiled", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), PJRT_DEVICE="CPU")
    env.pop("NXD_CPU_MODE", None)
    p = subprocess.run([sys.executable, "-m", "test.support.hlo.dry_run", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "token-generation buckets [100, 256] must be multiples of index_block_size" in p.stderr
    assert "--token-buckets" in p.stderr
    assert not out.exists()
