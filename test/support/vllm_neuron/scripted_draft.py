"""A draft with a KNOWN acceptance on the vLLM Neuron draft contract (test only): it reads ``script.json`` beside the
draft checkpoint, ``{"sequence": [prompt + the target's greedy continuation], "prompt_len": P, "agree": [bool per
generated index]}``, and for a row whose bonus token sits at position ``p`` of that sequence proposes, for positions
``q = p + 1 .. p + k``, the sequence's token where ``agree[q - P]`` and another token elsewhere (no model runs). A row
that is not on the sequence gets token 0 for every draft.

With a greedy target the verify steps then accept exactly what the pattern says, so the harness's handling of
accepted drafts (several tokens a step, the scheduler rolling back the rejected ones, their pages overwritten) is
graded against a hand count. Register it over the real draft: ``M3_VNEURON_MODELS=minimax_m3.vllm_neuron.plugin:
models,test.support.vllm_neuron.scripted_draft:MODELS``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from minimax_m3.vllm_neuron.contract import KVSpec, LayerSpec
from minimax_m3.vllm_neuron.eagle3 import accepted_tokens
from minimax_m3.vllm_neuron.plugin import DRAFT_ARCHITECTURE


class ScriptedDraft(nn.Module):
    def __init__(self, start_layer_idx: int):
        super().__init__()
        self.layer_name = f"layers.{start_layer_idx}.self_attn"
        self.num_speculative_tokens = 1
        self.script = None

    @classmethod
    def from_configs(cls, config=None, start_layer_idx: int = 0, neuron_config=None) -> ScriptedDraft:
        return cls(start_layer_idx)

    def load_weights(self, path, device=None, cache_dir=None) -> None:
        self.script = json.loads((Path(path) / "script.json").read_text())

    def get_kv_spec(self) -> KVSpec:
        return KVSpec(layers=[LayerSpec(self.layer_name, 1, 8, torch.float32)])

    def bind_kv_cache(self, kv_caches: dict) -> None:
        assert self.layer_name in kv_caches

    @torch.no_grad()
    def forward(self, input_ids, positions, initial_target_hidden_states, attn_metadata=None, sampling_positions=None,
                rank=None, raw_sampled_token_ids=None, **kw):
        seq, start, agree = self.script["sequence"], self.script["prompt_len"], self.script["agree"]
        k = self.num_speculative_tokens
        ids, last, bonus = accepted_tokens(input_ids.long(), sampling_positions.long(), raw_sampled_token_ids,
                                           1 << 30, k)
        rows = []
        for p_prev, b in zip(positions[last].tolist(), bonus.tolist()):
            p = p_prev + 1  # the bonus token's position
            on = p < len(seq) and seq[p] == b
            row = []
            for q in range(p + 1, p + 1 + k):
                g = q - start
                right = seq[q] if on and q < len(seq) else 0
                row.append(right if on and g < len(agree) and agree[g] else (right + 1) % 509)
            rows.append(row)
        drafts = torch.tensor(rows, dtype=torch.int32)
        return torch.cat([bonus.view(-1, 1).to(torch.int32), drafts], 1), drafts, None


MODELS = {DRAFT_ARCHITECTURE: ScriptedDraft}
