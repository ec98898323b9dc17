"""A tiny model written to the vLLM Neuron 1.x model contract, plain torch, for testing the off-device harness.

2 layers of grouped-query attention (4 query heads, 2 KV heads of 8) with rotary positions and a SiLU MLP, vocab 64,
float32. With ``index_head_size`` (config ``toy_index_head_size``) each layer also keeps "index keys" in a cache of its
own, a second LayerSpec (``layers.{i}.self_attn.indexer``, one head of that size: M3's sparse-attention index keys
in miniature), and adds ``q_idx . k_idx`` to every attention score, so a wrong page of index keys changes the tokens.
The contract (docs/notes/vllm_neuron_runner.md):

* ``from_configs(hf_config, neuron_config)`` (the runner builds it under ``torch.device("meta")``), then
  ``load_weights(path, device, cache_dir)`` materialises the parameters (``load_state_dict(assign=True)``);
* ``get_kv_spec()``: one LayerSpec per layer, ``layers.{i}.self_attn``; ``bind_kv_cache({name: [k, v]})``, each
  ``[num_blocks, num_kv_heads, block_size, head_size]``;
* ``forward(input_ids, positions, attn_metadata, sampling_positions, ...)`` -> logits ``[len(sampling_positions),
  vocab]``. The model writes its own K/V at ``slot_mapping`` (``// block_size``, ``% block_size``) before it
  attends. A prefill forward (``max_query_len > decode_token_threshold``) is one request: with
  ``kv_segment_size == 0`` it attends its own tokens only (single-shot prefill, as the plugin's Qwen3 does), else it
  reads the whole context through its block-table row (segmented prefill: the prior ``cached_seq_len`` tokens and
  its own); a decode forward reads each request's row of ``block_table_tensor`` (``-1`` = no block).

:func:`dense_greedy` is the oracle: the same weights, no pages, the whole sequence recomputed for every token.
"""

from __future__ import annotations

import json
import math

from pathlib import Path

import torch
from torch import nn

from minimax_m3.vllm_neuron.contract import KVSpec, LayerSpec

ARCH = "M3ToyForCausalLM"
SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, intermediate_size=64)
THETA = 10000.0
EPS = 1e-6


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d], positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None, :], torch.cat([ang, ang], -1).sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attend(q, k, v, mask, scale, bias=None):
    """q [B, H, S, d], k/v [B, H, K, d], mask [B, 1, S, K], bias [B, 1, S, K] -> [B, H, S, d]; rows without a key
    give 0."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask, float("-inf"))
    any_key = mask.any(-1, keepdim=True)
    probs = torch.where(any_key, torch.softmax(torch.where(any_key, scores, torch.zeros_like(scores)), -1), 0.0)
    return probs @ v


class ToyForCausalLM(nn.Module):
    def __init__(self, hf_config, neuron_config=None):
        super().__init__()
        c = {k: getattr(hf_config, k) for k in SIZES}
        self.vocab, self.hidden, self.layers = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.neuron_config = neuron_config
        self.index_dim = int(getattr(hf_config, "toy_index_head_size", 0) or 0)
        h, f, qd, kd = self.hidden, c["intermediate_size"], self.heads * self.head_dim, self.kv_heads * self.head_dim

        def p(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=torch.float32))

        self.embed = p(self.vocab, h)
        self.lm_head = p(h, self.vocab)
        self.norm = p(h)
        self.blocks = nn.ModuleList()
        for _ in range(self.layers):
            b = nn.Module()
            b.ln1, b.ln2, b.wq, b.wk, b.wv, b.wo, b.w1, b.w3, b.w2 = (
                p(h), p(h), p(h, qd), p(h, kd), p(h, kd), p(qd, h), p(h, f), p(h, f), p(f, h))
            if self.index_dim:
                b.wqi, b.wki = p(h, self.index_dim), p(h, self.index_dim)
            self.blocks.append(b)
        self.caches: dict[str, list[torch.Tensor]] = {}

    # ------------------------------------------------------------ contract
    @classmethod
    def from_configs(cls, hf_config, neuron_config):
        return cls(hf_config, neuron_config)

    def layer_name(self, i: int) -> str:
        return f"layers.{i}.self_attn"

    def index_name(self, i: int) -> str:
        return f"layers.{i}.self_attn.indexer"

    def get_kv_spec(self) -> KVSpec:
        specs = [LayerSpec(self.layer_name(i), self.kv_heads, self.head_dim, torch.float32) for i in range(self.layers)]
        if self.index_dim:
            specs += [LayerSpec(self.index_name(i), 1, self.index_dim, torch.float32) for i in range(self.layers)]
        return KVSpec(specs)

    def bind_kv_cache(self, kv_caches: dict) -> None:
        for i in range(self.layers):
            k, v = kv_caches[self.layer_name(i)]
            assert k.shape[1:] == (self.kv_heads, k.shape[2], self.head_dim), k.shape
            self.caches[self.layer_name(i)] = [k, v]
            if self.index_dim:
                ki, vi = kv_caches[self.index_name(i)]
                assert ki.shape[1:] == (1, ki.shape[2], self.index_dim), ki.shape
                self.caches[self.index_name(i)] = [ki, vi]

    def load_weights(self, checkpoint_path: str, device, cache_dir=None) -> None:
        from safetensors.torch import load_file

        sd = load_file(str(Path(checkpoint_path) / "model.safetensors"), device=str(device))
        self.load_state_dict(sd, strict=True, assign=True)

    def forward(self, input_ids, positions, attn_metadata=None, sampling_positions=None, sampling_params=None,
                spec_decode_metadata=None, rank=None, logit_mask=None, inputs_embeds=None, is_token_ids=None, **kw):
        x = self.embed[input_ids.long()]
        for i, b in enumerate(self.blocks):
            x = x + self._paged_attention(i, _rms(x, b.ln1), positions, attn_metadata)
            x = x + self._mlp(b, _rms(x, b.ln2))
        logits = _rms(x, self.norm)[sampling_positions] @ self.lm_head
        if logit_mask is not None:
            logits = logits.masked_fill(~logit_mask, float("-inf"))
        return logits

    # ------------------------------------------------------------ pieces
    def _mlp(self, b, x):
        return (torch.nn.functional.silu(x @ b.w1) * (x @ b.w3)) @ b.w2

    def _qkv(self, i, x, positions):
        b = self.blocks[i]
        t = x.shape[0]
        q = _rope((x @ b.wq).view(t, self.heads, self.head_dim), positions)
        k = _rope((x @ b.wk).view(t, self.kv_heads, self.head_dim), positions)
        v = (x @ b.wv).view(t, self.kv_heads, self.head_dim)
        return q, k, v

    def _index(self, i, x):
        """The index query and key of every token, [T, d_i] each, or None."""
        if not self.index_dim:
            return None, None
        b = self.blocks[i]
        return x @ b.wqi, x @ b.wki

    def _paged_attention(self, i, x, positions, attn_metadata):
        meta = attn_metadata[self.layer_name(i)]
        q, k, v = self._qkv(i, x, positions)
        qi, ki = self._index(i, x)
        k_cache, v_cache = self.caches[self.layer_name(i)]
        bs = meta["block_size"]
        slots = meta["slot_mapping"]
        # writes first: every token's K/V at its slot (padding slots are the null block 0)
        k_cache[slots // bs, :, slots % bs, :] = k
        v_cache[slots // bs, :, slots % bs, :] = v
        if ki is not None:  # the index keys: their own spec's metadata (same group: same slots and block table)
            im = attn_metadata[self.index_name(i)]
            ik_cache = self.caches[self.index_name(i)][0]
            islots, ibs = im["slot_mapping"], im["block_size"]
            ik_cache[islots // ibs, 0, islots % ibs, :] = ki
        scale = 1.0 / math.sqrt(self.head_dim)
        group = self.heads // self.kv_heads
        prefill = meta["max_query_len"] > meta["decode_token_threshold"]
        if prefill and meta["kv_segment_size"] == 0:  # single-shot prefill: its own tokens, causal
            t = x.shape[0]
            kk = k.repeat_interleave(group, 1).transpose(0, 1)[None]
            vv = v.repeat_interleave(group, 1).transpose(0, 1)[None]
            idx = torch.arange(t, device=x.device)
            mask = (idx[None, :] <= idx[:, None])[None, None]
            bias = None if qi is None else ((qi @ ki.T) / math.sqrt(self.index_dim))[None, None]
            out = _attend(q.transpose(0, 1)[None], kk, vv, mask, scale, bias)[0].transpose(0, 1)
        else:  # read the context through the block table: rows = requests, S query tokens each
            table = meta["block_table_tensor"].long()
            rows, width = table.shape
            s = x.shape[0] // rows
            valid = table >= 0
            safe = table.clamp(min=0)
            kk = k_cache[safe].permute(0, 2, 1, 3, 4).reshape(rows, self.kv_heads, width * bs, self.head_dim)
            vv = v_cache[safe].permute(0, 2, 1, 3, 4).reshape(rows, self.kv_heads, width * bs, self.head_dim)
            kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
            key_pos = torch.arange(width * bs, device=x.device)
            key_ok = valid.repeat_interleave(bs, 1)  # [rows, width*bs]
            qpos = positions.view(rows, s)
            mask = (key_pos[None, None, :] <= qpos[:, :, None]) & key_ok[:, None, :]
            qq = q.view(rows, s, self.heads, self.head_dim).transpose(1, 2)
            bias = None
            if qi is not None:
                im = attn_metadata[self.index_name(i)]
                itable = im["block_table_tensor"].long().clamp(min=0)
                assert itable.shape == table.shape and im["block_size"] == bs  # one KV cache group
                ik_cache = self.caches[self.index_name(i)][0]
                ki_ctx = ik_cache[itable][:, :, 0].reshape(rows, width * bs, self.index_dim)
                bias = ((qi.view(rows, s, self.index_dim) @ ki_ctx.transpose(1, 2)) / math.sqrt(self.index_dim))
                bias = bias[:, None]
            out = _attend(qq, kk, vv, mask[:, None], scale, bias).transpose(1, 2).reshape(rows * s, self.heads,
                                                                                         self.head_dim)
        return out.reshape(x.shape[0], -1) @ self.blocks[i].wo

    @torch.no_grad()
    def dense_logits(self, ids: list[int]) -> torch.Tensor:
        """The oracle's forward: the whole sequence, causal attention over its own K/V, no cache."""
        x = self.embed[torch.tensor(ids)]
        pos = torch.arange(len(ids))
        scale = 1.0 / math.sqrt(self.head_dim)
        group = self.heads // self.kv_heads
        mask = (pos[None, :] <= pos[:, None])[None, None]
        for i, b in enumerate(self.blocks):
            xn = _rms(x, b.ln1)
            q, k, v = self._qkv(i, xn, pos)
            qi, ki = self._index(i, xn)
            bias = None if qi is None else ((qi @ ki.T) / math.sqrt(self.index_dim))[None, None]
            kk = k.repeat_interleave(group, 1).transpose(0, 1)[None]
            vv = v.repeat_interleave(group, 1).transpose(0, 1)[None]
            a = _attend(q.transpose(0, 1)[None], kk, vv, mask, scale, bias)[0].transpose(0, 1)
            x = x + a.reshape(len(ids), -1) @ b.wo
            x = x + self._mlp(b, _rms(x, b.ln2))
        return _rms(x, self.norm) @ self.lm_head


MODELS = {ARCH: ToyForCausalLM}


def write_checkpoint(path: Path, seed: int = 0, index_head_size: int = 0) -> Path:
    """config.json (a Llama config transformers parses, architecture ``M3ToyForCausalLM``) and model.safetensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(SIZES, architectures=[ARCH], model_type="llama", max_position_embeddings=1024, rms_norm_eps=EPS,
               torch_dtype="float32", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               toy_index_head_size=index_head_size)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))

    class _C:
        pass

    c = _C()
    for k, val in SIZES.items():
        setattr(c, k, val)
    c.toy_index_head_size = index_head_size
    model = ToyForCausalLM(c)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, prm in model.named_parameters():
        if name.endswith(("ln1", "ln2", "norm")):
            sd[name] = 1.0 + 0.1 * torch.randn(prm.shape, generator=g)
        elif name == "embed":
            sd[name] = torch.randn(prm.shape, generator=g)
        else:
            sd[name] = torch.randn(prm.shape, generator=g) * (1.5 / math.sqrt(prm.shape[0]))
    save_file(sd, str(path / "model.safetensors"))
    return path


def load_dense(path: Path) -> ToyForCausalLM:
    cfg = json.loads((Path(path) / "config.json").read_text())

    class _C:
        pass

    c = _C()
    for k in SIZES:
        setattr(c, k, cfg[k])
    c.toy_index_head_size = cfg.get("toy_index_head_size", 0)
    model = ToyForCausalLM(c)
    model.load_weights(str(path), "cpu")
    return model.eval()


@torch.no_grad()
def dense_greedy(model: ToyForCausalLM, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model.dense_logits(ids)[-1].argmax()))
    return ids[len(prompt):]
