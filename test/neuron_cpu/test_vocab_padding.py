"""A vocabulary that does not divide by the TP degree, graded against golden logits in NxDI's CPU mode.

NxD's ``ColumnParallelLinear(pad=True)`` pads the LM head to a multiple of TP and NxDI masks the padded columns
of the logits to the dtype's minimum. With 511 tokens (7 x 73) TP 2 and TP 4 both pad one column, right after
the last real token (510): if the port's head trims the padding before NxDI masks "the last pad_size columns",
token 510's logit comes back as float32's minimum. At TP 1 nothing is padded (the same checks, no padding).

Golden logits are written by ``minimax-m3 golden`` (the reference backend, float32), in a child process without
torchrun's variables: the reference's own tensor parallelism needs a vocabulary that divides by the world size.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minimax_m3.config import M3Config
from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 511  # odd and 7 x 73: one padded column at TP 2 and at TP 4
TOL = 1e-4  # float32 end to end, as test_port_cpu
STEPS = 4
PROMPTS = [random_ids(21, seed=21, vocab=VOCAB), random_ids(9, seed=22, vocab=VOCAB)]
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT")


@pytest.fixture(scope="module")
def ckpt_and_golden(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    d = tmp_path_factory.mktemp("vocab511")
    ckpt = write_synthetic(d / "ckpt", M3Config.preset("tiny").replace(vocab_size=VOCAB), seed=3)
    prompts, out = d / "prompts.jsonl", d / "golden.safetensors"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    cmd = [sys.executable, "-m", "minimax_m3.cli", "golden", "--model", str(ckpt), "--prompts", str(prompts),
           "--out", str(out), "--decode-steps", str(STEPS), "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ckpt, load_file(out)


@pytest.fixture(scope="module")
def port(ckpt_and_golden):
    from minimax_m3.load import load_engine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    return load_engine(str(ckpt_and_golden[0]), backend="neuron-cpu",
                       **neuron_cpu_engine_kwargs(batch_size=2, max_seq_len=32, max_context_length=24))


def test_lm_head_is_padded_at_this_tp(port, neuron_cpu_tp):
    """The case under test is really here: NxD pads the head by (-511) mod TP columns."""
    head = port.app.models[0].model.lm_head
    assert head.pad_size == (-VOCAB) % neuron_cpu_tp
    if neuron_cpu_tp > 1:
        assert head.pad_size == 1


def test_prefill_and_decode_logits_with_the_last_token(port, ckpt_and_golden):
    _, golden = ckpt_and_golden
    res = port.generate(PROMPTS, GenerationConfig(max_new_tokens=STEPS, return_logits=True))
    for i, r in enumerate(res):
        want = golden[f"{i}.step_logits"]  # row 0: the prompt's last position (prefill), then decode steps
        assert r.step_logits.shape == want.shape == (STEPS, VOCAB)
        assert torch.isfinite(want).all() and want[:, -1].abs().max() < 100  # the oracle's last token is ordinary
        assert (r.step_logits[:, -1] - want[:, -1]).abs().max() <= TOL  # token 510, next to the padding
        assert (r.step_logits - want).abs().max() <= TOL
        assert r.tokens == golden[f"{i}.tokens"].tolist()
