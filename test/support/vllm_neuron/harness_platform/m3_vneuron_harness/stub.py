"""What vLLM's ModelRegistry is given for a contract architecture: a stub satisfying vLLM 0.24's text-generation
protocol (``vllm/model_executor/models/interfaces_base.py``: ``__init__(vllm_config=...)``, ``embed_input_ids``,
``forward(input_ids, positions)``, ``compute_logits``). vLLM 0.24 refuses ``--runner generate`` for a registered class
without it (``vllm/config/model.py``, "This model does not support `--runner generate`"), and a contract factory
(``from_configs``/``forward(..., attn_metadata, ...)``) lacks it. vLLM only inspects the stub; the harness's runner
builds the contract model from the registry."""

from __future__ import annotations

from torch import nn


class ContractArchitectureStub(nn.Module):
    def __init__(self, *, vllm_config=None, prefix: str = ""):
        super().__init__()
        raise RuntimeError("the harness builds contract models itself; vLLM must not instantiate this stub")

    def embed_input_ids(self, input_ids):
        raise NotImplementedError

    def forward(self, input_ids, positions, **kwargs):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError


def stub_for(arch: str) -> type[nn.Module]:
    return type(arch, (ContractArchitectureStub,), {"__module__": __name__})
