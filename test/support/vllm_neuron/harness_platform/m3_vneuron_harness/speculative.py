"""The harness's EAGLE3 (``--speculative-config '{"method": "eagle3", ...}'``): the draft built as the plugin's
proposer builds it, and the acceptance of a verify step's drafts.

The proposer (``E@`` = ``vllm_neuron/vllm/spec_decode/eagle.py`` at ed3580d): the draft class is the registry's
``Eagle3<draft architecture>`` (unless the architecture starts with ``Eagle3``), built on the meta device with
``from_configs(config=<the draft's hf_config>, start_layer_idx=<target layers>, neuron_config=...)``, then
``num_speculative_tokens`` set, ``load_weights(draft path, device, download_dir)``, ``.to(device)``; its layers
``layers.{N + i}.self_attn`` must share the target's KV cache group. ``propose`` hands the draft the target call's
tokens shifted by one (the last repeated), its positions, the target's states, the rows' last token indices, the
rows' sampled tokens (``raw [rows, 1 | 1 + k]``, ``-1`` after a row's bonus) and the target's ``attn_metadata``
filtered to the draft's layers; it returns ``(stacked, drafts_only)``.

The rejection sampler: the plugin's host one (``vllm_neuron.vllm.sample.rejection_sampler``) was not readable, and
vLLM 0.24's own is Triton-only (``vllm/v1/sample/rejection_sampler.py:714``), so the harness stands in with this
package's one home of the rule (``minimax_m3.engine.speculative.verify``): greedy rows keep the drafts equal to the
target's argmax, then the argmax after them (plain greedy's tokens, token for token); sampled rows run speculative
sampling with the request's temperature, top-k and top-p, the draft's distribution a point mass (greedy drafting),
seeded per request (penalties and logits processors are not applied to verify rows).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def draft_class_name(architecture: str) -> str:
    """E@: ``Eagle3`` prefixed unless the architecture starts with it."""
    return architecture if architecture.startswith("Eagle3") else f"Eagle3{architecture}"


def target_layers(model_config) -> int:
    hf = model_config.hf_config
    n = getattr(hf, "num_hidden_layers", None)
    return int(n if n is not None else model_config.hf_text_config.num_hidden_layers)


class Proposer:
    """The draft model, loaded and bound as the plugin's ``EagleProposer`` does (module docstring)."""

    def __init__(self, vllm_config, device: torch.device, registry: dict):
        spec = vllm_config.speculative_config
        if spec.method != "eagle3":
            raise NotImplementedError(f"speculative method {spec.method!r}: the plugin's proposer runs eagle3 only "
                                      "(E@ EagleProposer asserts it)")
        self.k = int(spec.num_speculative_tokens)
        dmc = spec.draft_model_config
        name = draft_class_name(dmc.architecture)
        if name not in registry:
            raise ValueError(f"Draft model architecture '{name}' not found in the registry; supported: "
                             f"{sorted(registry)}")
        start = target_layers(vllm_config.model_config)
        with torch.device("meta"):
            model = registry[name].from_configs(config=dmc.hf_config, start_layer_idx=start,
                                                neuron_config=SimpleNamespace(on_device_sampling_config=None))
        model.num_speculative_tokens = self.k
        model.load_weights(spec.model, device, vllm_config.load_config.download_dir)
        self.model = model.to(device)
        self.layer_names = [f"layers.{i}.self_attn"
                            for i in range(start, start + int(getattr(dmc.hf_config, "num_hidden_layers", 1)))]
        self.aux_layers = getattr(dmc.hf_config, "eagle_aux_hidden_state_layer_ids", None)

    def check_group(self, layer_group: dict) -> None:
        """E@ ``validate_same_kv_cache_group``."""
        if len({layer_group[n] for n in self.layer_names}) != 1:
            raise RuntimeError("All eagle layers should belong to the same kv cache group")

    def propose(self, kwargs: dict, states: torch.Tensor, last: torch.Tensor, raw: torch.Tensor):
        """E@ ``propose`` for one target forward (its kwargs, its states ``[T, 3 x hidden]``)."""
        ids = kwargs["input_ids"]
        shifted = torch.cat([ids[1:], ids[-1:]]) if ids.shape[0] > 1 else ids.clone()
        meta = {n: kwargs["attn_metadata"][n] for n in self.layer_names}
        with torch.inference_mode():
            stacked, drafts_only, _ = self.model(
                input_ids=shifted, positions=kwargs["positions"], initial_target_hidden_states=states,
                attn_metadata=meta, sampling_positions=last, rank=kwargs["rank"], raw_sampled_token_ids=raw)
        return stacked, drafts_only


def accept(logits: torch.Tensor, drafts: list[int], sampling_params, seed: int, position: int) -> list[int]:
    """A verify row's tokens: the accepted drafts and the token after them (module docstring). ``logits
    [len(drafts) + 1, vocab]``; ``position``: the first draft's."""
    from minimax_m3.engine.loop import GenerationConfig
    from minimax_m3.engine.speculative import verify

    sp = sampling_params
    gen = GenerationConfig(temperature=float(sp.temperature), top_k=max(int(sp.top_k or 0), 0),
                           top_p=float(sp.top_p))
    qs = [torch.nn.functional.one_hot(torch.tensor(d), logits.shape[-1]).float() for d in drafts]
    a, token = verify(logits.float(), drafts, qs, gen, seed, position)
    return list(drafts[:a]) + [int(token)]
