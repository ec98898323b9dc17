"""The vLLM Neuron model on its contract, driven as the plugin's runner drives it, against transformers' MiniMax-M3.

Without vLLM: the test builds what the runner builds (``get_kv_spec`` → pages ``[num_blocks, heads, block, dim]`` per
spec, ``bind_kv_cache``, ``attn_metadata`` per spec with ``slot_mapping`` / ``block_table_tensor``, flat
``input_ids``/``positions``, ``sampling_positions``) over shuffled physical pages, and feeds a prompt in segments that
start mid-page (segmented prefill after cached tokens, a prefix-cache hit), then batched decode steps of two rows at
other positions and a 4-token verify step. Every logit is graded against transformers' ``minimax_m3_vl`` run on the
whole sequence at once (the independent oracle; float32, max |Δ| <= 2e-4 as the reference's own grade), past the
point where the indexer selects (tiny preset: 16-token blocks, top-2). Under real vLLM (scheduler, prefix caching,
chunked prefill) the model is exercised by ``test/vllm_neuron``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from minimax_m3.errors import ServingError
from minimax_m3.vllm_neuron.contract import attention_spec
from minimax_m3.vllm_neuron.model import MiniMaxM3ForCausalLM
from test.conftest import random_ids

F32_TOL = 2e-4


class _HF(SimpleNamespace):
    def to_dict(self):
        return dict(self.raw)


def _hf_config(ckpt, **over):
    raw = json.loads((ckpt / "config.json").read_text()) | over
    return _HF(raw=raw, architectures=raw.get("architectures"), torch_dtype=torch.float32)


def _model(ckpt, num_blocks=64, seed=0):
    m = MiniMaxM3ForCausalLM.from_configs(_hf_config(ckpt), SimpleNamespace(torch_dtype=torch.float32))
    m.load_weights(str(ckpt), "cpu", None)
    caches = {}
    for spec in m.get_kv_spec().layers:
        shape = (num_blocks, spec.num_kv_heads, m.config.index_block_size, spec.head_size)
        # unwritten slots hold large finite values: a read of anything not written fails the grade
        caches[spec.name] = [torch.full(shape, 1e3, dtype=spec.dtype), torch.full(shape, -1e3, dtype=spec.dtype)]
    m.bind_kv_cache(caches)
    return m


def _meta(m, slots, table):
    md = {"slot_mapping": torch.tensor(slots, dtype=torch.int64), "block_table_tensor": table.to(torch.int32),
          "block_size": m.config.index_block_size}
    return {attention_spec(i): md for i in range(m.config.num_layers)}


def _slots(table_row, positions, p):
    return [int(table_row[q // p]) * p + q % p for q in positions]


def _hf_all(hf, ids):
    x = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()


def test_segments_decode_and_verify_match_transformers(tiny_ckpt, hf_tiny):
    m = _model(tiny_ckpt)
    p = m.config.index_block_size
    gen = torch.Generator().manual_seed(3)
    pages = (torch.randperm(63, generator=gen)[:32] + 1).view(2, 16)  # page 0 is vLLM's null page
    a, b = random_ids(150, seed=11), random_ids(120, seed=12)  # 150 tokens: 10 blocks, the indexer keeps 2
    want_a, want_b = _hf_all(hf_tiny, a), _hf_all(hf_tiny, b)
    # prompts in segments: a from 0 (37 tokens, ends mid-page), then 27 more (a segment after cached tokens), then
    # up to 140; b in one call of 100 tokens
    for row, ids, cuts in ((0, a, (0, 37, 64, 140)), (1, b, (0, 100))):
        for s0, s1 in zip(cuts, cuts[1:]):
            pos = list(range(s0, s1))
            got = m.forward(torch.tensor(ids[s0:s1]), torch.tensor(pos),
                            attn_metadata=_meta(m, _slots(pages[row], pos, p), pages[row:row + 1]),
                            sampling_positions=torch.arange(s1 - s0))
            want = want_a if row == 0 else want_b
            assert (got - want[s0:s1]).abs().max().item() <= F32_TOL, (row, s0, s1)
    # decode: both rows in one batch, one token each, at their own positions (a at 140.., b at 100..)
    for step in range(6):
        pos = [140 + step, 100 + step]
        toks = [a[pos[0]], b[pos[1]]]
        slots = [_slots(pages[r], [pos[r]], p)[0] for r in range(2)]
        got = m.forward(torch.tensor(toks), torch.tensor(pos), attn_metadata=_meta(m, slots, pages),
                        sampling_positions=torch.arange(2))
        assert (got[0] - want_a[pos[0]]).abs().max().item() <= F32_TOL
        assert (got[1] - want_b[pos[1]]).abs().max().item() <= F32_TOL
    # a verify step: 4 tokens per row (speculative decoding's target call)
    pos = [list(range(146, 150)), list(range(106, 110))]
    toks = [a[q] for q in pos[0]] + [b[q] for q in pos[1]]
    slots = _slots(pages[0], pos[0], p) + _slots(pages[1], pos[1], p)
    got = m.forward(torch.tensor(toks), torch.tensor(pos[0] + pos[1]), attn_metadata=_meta(m, slots, pages),
                    sampling_positions=torch.arange(8))
    assert (got[:4] - want_a[146:150]).abs().max().item() <= F32_TOL
    assert (got[4:] - want_b[106:110]).abs().max().item() <= F32_TOL


def test_padding_tokens_touch_no_row(tiny_ckpt, hf_tiny):
    """A bucket padded past the prompt (slot -1, position 0): the padding writes only the null page."""
    m = _model(tiny_ckpt)
    p = m.config.index_block_size
    pages = torch.arange(1, 11).view(1, 10)
    ids = random_ids(40, seed=5)
    pos = list(range(40))
    slots = _slots(pages[0], pos, p) + [-1] * 8
    got = m.forward(torch.tensor(ids + [0] * 8), torch.tensor(pos + [0] * 8),
                    attn_metadata=_meta(m, slots, pages), sampling_positions=torch.tensor([39]))
    assert (got[0] - _hf_all(hf_tiny, ids)[39]).abs().max().item() <= F32_TOL


def test_start_up_refusals_name_the_option(tiny_ckpt):
    nc = SimpleNamespace(torch_dtype=torch.float32)
    with pytest.raises(ServingError, match="LlamaForCausalLM"):
        MiniMaxM3ForCausalLM.from_configs(_hf_config(tiny_ckpt, architectures=["LlamaForCausalLM"]), nc)
    with pytest.raises(ServingError, match="--dtype bfloat16"):
        MiniMaxM3ForCausalLM.from_configs(_hf_config(tiny_ckpt), SimpleNamespace(torch_dtype=torch.float16))
    with pytest.raises(ServingError, match="on_device_sampling_config.sampling_dp_degree 2"):
        MiniMaxM3ForCausalLM.from_configs(_hf_config(tiny_ckpt), SimpleNamespace(
            torch_dtype=torch.float32, on_device_sampling_config={"sampling_dp_degree": 2}))
    m = MiniMaxM3ForCausalLM.from_configs(_hf_config(tiny_ckpt), nc)
    caches = {s.name: [torch.zeros(4, s.num_kv_heads, 32, s.head_size)] * 2 for s in m.get_kv_spec().layers}
    with pytest.raises(ServingError, match="--block-size 16"):
        m.bind_kv_cache(caches)


def test_eagle3_target_states_are_transformers_hidden_states(tiny_ckpt, hf_tiny):
    """With a draft's layers set, the forward also returns the residual streams entering them at every token
    (vLLM's EAGLE3 indexing: transformers' ``hidden_states[j]`` enters layer ``j``)."""
    m = _model(tiny_ckpt)
    m.set_aux_hidden_state_layers([3, 1])
    ids = random_ids(50, seed=9)
    pages = torch.arange(1, 5).view(1, 4)
    pos = list(range(50))
    logits, states = m.forward(torch.tensor(ids), torch.tensor(pos),
                               attn_metadata=_meta(m, _slots(pages[0], pos, m.config.index_block_size), pages),
                               sampling_positions=torch.tensor([49]))
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf_tiny(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True)
    want = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], dim=-1).float()
    assert states.shape == (50, 2 * m.config.hidden_size)
    assert (states - want).abs().max().item() <= F32_TOL
    assert (logits[0] - out.logits[0, 49].float()).abs().max().item() <= F32_TOL
