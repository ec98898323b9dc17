"""The harness itself, graded by an independent oracle: NxDI's stock ``NeuronLlamaForCausalLM`` run through our
stand-ins in CPU mode equals transformers' Llama (prefill and one decode step), at this process's TP degree.

If the stand-ins changed what NxDI computes, this would fail before any MiniMax-M3 test is believed.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.neuron_cpu


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from neuronx_distributed_inference.models.config import NeuronConfig
    from neuronx_distributed_inference.models.llama.modeling_llama import (
        LlamaInferenceConfig, NeuronLlamaForCausalLM,
    )
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    nc = NeuronConfig(tp_degree=tp, batch_size=1, seq_len=32, torch_dtype=torch.float32, attn_kernel_enabled=False,
                      on_cpu=True)
    app = NeuronLlamaForCausalLM(str(path), LlamaInferenceConfig(nc, load_config=load_pretrained_config(str(path))))
    app.to_cpu()
    return app, hf


def test_stock_llama_matches_transformers(llama_pair):
    app, hf = llama_pair
    ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    s = ids.shape[1] - 1
    with torch.no_grad():
        ref = hf(ids).logits[0]
    app.reset()
    pre = app(input_ids=ids[:, :s], attention_mask=torch.ones(1, s, dtype=torch.long),
              position_ids=torch.arange(s).unsqueeze(0), seq_ids=torch.arange(1)).logits[0, -1]
    # a decode step's 2-D mask covers the prior tokens only; NxDI adds the active token itself
    dec = app(input_ids=ids[:, s:], attention_mask=torch.ones(1, s, dtype=torch.long),
              position_ids=torch.tensor([[s]]), seq_ids=torch.arange(1)).logits[0, -1]
    assert (pre - ref[s - 1]).abs().max() < 1e-5
    assert (dec - ref[s]).abs().max() < 1e-5
    assert (dec - ref[s - 1]).abs().max() > 1e-2  # the two positions really differ
