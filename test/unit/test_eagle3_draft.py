"""The EAGLE3 draft layer against an independent oracle: transformers' Llama pieces (``LlamaAttention`` with its
q/k/v widened to 2 x hidden as EAGLE3's first layer has them, ``LlamaRMSNorm``, ``LlamaMLP``, ``LlamaRotaryEmbedding``
incl. Llama-3 scaling), composed as vLLM's ``llama_eagle3`` layer does. Float32; also the cached, chunked forward
against the one-shot forward, and the draft-to-target vocabulary map."""


import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from minimax_m3.checkpoint.draft import canonical, synthetic_tensors
from minimax_m3.config.draft import DraftConfig
from minimax_m3.reference.eagle3 import DraftCache, build_draft, rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {
    "mha": DraftConfig(hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=96, vocab_size=100,
                       draft_vocab_size=40, target_hidden_size=64, rms_norm_eps=1e-6, rope_theta=10000.0),
    "gqa-llama3-norm-first": DraftConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                         intermediate_size=96, vocab_size=100, draft_vocab_size=100,
                                         target_hidden_size=48, rms_norm_eps=1e-5, rope_theta=500000.0,
                                         rope_scaling=LLAMA3, norm_before_residual=True),
}


def _draft(dc: DraftConfig):
    tensors = {canonical(k): v.float() for k, v in synthetic_tensors(dc, seed=1).items()}
    g = torch.Generator().manual_seed(2)
    target = {"embed_tokens.weight": torch.randn(dc.vocab_size, dc.hidden_size, generator=g),
              "lm_head.weight": torch.randn(dc.vocab_size, dc.hidden_size, generator=g)}
    if dc.hidden_size != dc.target_hidden_size:
        tensors["embed_tokens.weight"] = torch.randn(dc.vocab_size, dc.hidden_size, generator=g)
    return build_draft(dc, tensors, target, torch.float32, "cpu"), tensors


def _oracle(dc: DraftConfig, d, ids, hidden, positions):
    """(pre-norm output, draft-vocabulary logits) of transformers' Llama pieces composed as EAGLE3's layer."""
    cfg = LlamaConfig(hidden_size=dc.hidden_size, num_attention_heads=dc.num_heads,
                      num_key_value_heads=dc.num_kv_heads, head_dim=dc.head_dim, intermediate_size=dc.intermediate_size,
                      vocab_size=dc.vocab_size, rms_norm_eps=dc.rms_norm_eps, rope_theta=dc.rope_theta,
                      rope_scaling=dc.rope_scaling, max_position_embeddings=4096)
    cfg._attn_implementation = "eager"
    attn = hf.LlamaAttention(cfg, 0)
    h2 = 2 * dc.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        src = getattr(d, name).weight
        lin = torch.nn.Linear(h2, src.shape[0], bias=False)
        lin.weight.data.copy_(src)
        setattr(attn, name, lin)
    attn.o_proj.weight.data.copy_(d.o_proj.weight)
    mlp = hf.LlamaMLP(cfg)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).weight.data.copy_(getattr(d, name).weight)

    def norm(w):
        n = hf.LlamaRMSNorm(dc.hidden_size, eps=dc.rms_norm_eps)
        n.weight.data.copy_(w)
        return n

    e = norm(d.input_layernorm)(torch.nn.functional.embedding(ids, d.embed_tokens.weight))
    h = norm(d.hidden_norm)(hidden)
    x = torch.cat([e, h], dim=-1)
    cos, sin = hf.LlamaRotaryEmbedding(cfg)(x, positions)
    t = ids.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1).view(1, 1, t, t)
    a, _ = attn(x, (cos, sin), mask)
    residual = (h if dc.norm_before_residual else hidden) + a
    out = residual + mlp(norm(d.post_attention_layernorm)(residual))
    return out, norm(d.norm)(out) @ d.lm_head.weight.T


@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_layer_equals_transformers_llama_pieces(case):
    dc = CASES[case]
    d, tensors = _draft(dc)
    g = torch.Generator().manual_seed(3)
    t = 11
    ids = torch.randint(0, dc.vocab_size, (1, t), generator=g)
    states = torch.randn(1, t, 3 * dc.target_hidden_size, generator=g)
    hidden = d.combine(states)
    assert (hidden - states @ d.fc.weight.T).abs().max() < 1e-5  # fc over the three states
    positions = torch.arange(t).unsqueeze(0)
    logits, out = d(ids, hidden, positions, DraftCache(dc, 1, 64, torch.float32, "cpu"))
    want_out, want_logits = _oracle(dc, d, ids, hidden, positions)
    assert (out - want_out).abs().max() < 1e-4
    target_ids = torch.arange(dc.draft_vocab_size) + tensors.get("d2t", torch.zeros(dc.draft_vocab_size)).long()
    assert (logits[0][:, target_ids] - want_logits[0]).abs().max() < 1e-4
    off = torch.ones(dc.vocab_size, dtype=torch.bool)
    off[target_ids] = False
    assert torch.isinf(logits[0][:, off]).all()  # ids the draft vocabulary lacks are never proposed


def test_llama3_rope_equals_transformers():
    dc = CASES["gqa-llama3-norm-first"]
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=dc.rope_theta,
                      rope_scaling=LLAMA3, max_position_embeddings=4096)
    want = hf.LlamaRotaryEmbedding(cfg).inv_freq
    got = rope_inv_freq(dc)
    assert torch.allclose(got, want, rtol=1e-6) and not torch.allclose(got, rope_inv_freq(CASES["mha"]))


def test_cached_chunks_and_steps_equal_one_forward():
    """A catch-up of 6 positions, then 3 more, then one-token steps: the same outputs as one forward over all."""
    dc = CASES["mha"]
    d, _ = _draft(dc)
    g = torch.Generator().manual_seed(4)
    t = 12
    ids = torch.randint(0, dc.vocab_size, (1, t), generator=g)
    hidden = torch.randn(1, t, dc.hidden_size, generator=g)
    pos = torch.arange(t).unsqueeze(0)
    whole, whole_out = d(ids, hidden, pos, DraftCache(dc, 1, 32, torch.float32, "cpu"))
    cache = DraftCache(dc, 2, 32, torch.float32, "cpu").row(1)
    cache.k.fill_(7.0)  # stale entries past each position must not matter
    parts = []
    for a, b in ((0, 6), (6, 9), (9, 10), (10, 11), (11, 12)):
        parts.append(d(ids[:, a:b], hidden[:, a:b], pos[:, a:b], cache))
    assert (torch.cat([p[0] for p in parts], 1) - whole).nan_to_num(0).abs().max() < 1e-4
    assert (torch.cat([p[1] for p in parts], 1) - whole_out).abs().max() < 1e-4
