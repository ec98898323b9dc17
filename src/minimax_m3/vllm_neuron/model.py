"""MiniMax-M3 on vLLM Neuron's model contract: the factory the plugin builds, compiles and drives.

The contract (vllm-neuron 0.24.0.1.1.0, ``jinhuang12/vllm-neuron`` at ``ed3580d``: ``vllm_neuron/model/qwen3/model.py``
is the pattern; ``docs/notes/vllm_neuron_runner.md`` cites the runner):

* ``from_configs(hf_config, neuron_config)`` builds the model for this rank (vLLM's tensor-parallel group);
* ``get_kv_spec()``: a K/V spec per layer and an index-key spec per sparse layer (:mod:`.paged_cache`);
* ``bind_kv_cache({name: [k, v]})`` hands over the pages; ``load_weights(path, device, cache_dir)`` loads the rank's
  weights from any published format (bf16, MXFP8, NVFP4) through ``checkpoint/``, as the reference does;
* ``forward(input_ids [T], positions [T], ..., attn_metadata, sampling_positions, ...)``: ``T`` flat tokens, ``B`` rows
  of ``T / B`` tokens each (``B`` = the block table's rows: one prompt segment, or a batch of decode / verify steps),
  returns float32 logits ``[len(sampling_positions), vocab]`` for vLLM's sampler, or with on-device sampling (the
  plugin's default, ``neuron_config.on_device_sampling_config``; :mod:`.sampling`) ``(token ids int32, logits)``
  drawn per the runner's ``sampling_params`` and ``logit_mask``; with an EAGLE3 draft the target states come second,
  and a verify step (``spec_decode_metadata`` given) runs the rejection here: ``(tokens [rows, 1 + k] with -1 after
  the last, states, logits, last token [rows])`` (``sampling.verify``).

The layers are the reference model's (:class:`minimax_m3.reference.model.M3Model`: the same parameters, TP/EP
slicing and math); only the cache differs. Parallel layout: query heads over the TP ranks, KV heads split or
replicated (the plugin's Qwen3 rule, NxD's), experts over ``ep`` expert-parallel groups: the neuron config's
``ep_degree`` (the plugin's own knob; default 1, experts tensor-parallel as in the plugin's MoE models). At TP 64,
``ep_degree: 64`` is the NxDI port's layout: each rank holds 2 whole experts, its expert matmuls keep the full
intermediate width, and one all-reduce sums routed and shared experts (no all-to-all). The plugin's
``quantization: "fp8"`` holds the routed experts as per-channel e4m3 (the NxDI port's ``--weights fp8``), each
product's output times its fp32 scale (``ops.moe.scaled``); the rest stays in the serving dtype. vLLM's
``decode_context_parallel_size`` deals each KV head's pages by whole blocks over that many of its ranks (vLLM's DCP
group; :mod:`.paged_cache`), which is how this path holds a 1M-token context.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import parallel
from ..config.m3 import M3Config
from ..errors import ServingError
from ..reference.loader import load_model
from ..reference.parallel import ShardPlan
from . import sampling
from .contract import QUANTIZATION, KVSpec, LayerSpec, Layout, attention_spec, check_serving, index_spec
from .paged_cache import PagedCache


def _tp_group() -> tuple[int, int, object]:
    """``(world, rank, process group)`` of vLLM's tensor-parallel group where it is initialised, else one rank."""
    try:
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    except ImportError:
        return 1, 0, None
    if not model_parallel_is_initialized():
        return 1, 0, None
    g = get_tp_group()
    return g.world_size, g.rank_in_group, (g.device_group if g.world_size > 1 else None)


def _dcp(world: int) -> tuple[int, int, object, bool]:
    """``(size, rank in it, ops.Group, speculative)``: vLLM's decode-context-parallel group where vLLM runs one
    (``parallel_config.decode_context_parallel_size``; its ranks consecutive in the TP group, ``tp_rank mod dcp``),
    else ``(1, 0, None, ...)``; and whether vLLM serves a draft beside the model."""
    try:
        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
        size = int(vc.parallel_config.decode_context_parallel_size or 1)
        speculative = vc.speculative_config is not None
    except Exception:  # no vLLM, or no config set (a test building the model directly)
        return 1, 0, None, False
    if size == 1 or world == 1:
        return 1, 0, None, speculative
    from vllm.distributed.parallel_state import get_dcp_group

    from ..reference.parallel import SequenceGroup

    g = get_dcp_group()
    return g.world_size, g.rank_in_group, SequenceGroup(g.world_size, g.device_group), speculative


def _dtype(hf_config, neuron_config) -> torch.dtype:
    """The serving dtype: vLLM's ``--dtype`` (its current model config, which the KV caches follow too) where vLLM
    is running, else the neuron config's, else the checkpoint's."""
    d = None
    try:
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
        d = getattr(model_config, "dtype", None)
    except Exception:  # no vLLM, or no config set (a test building the model directly)
        d = None
    d = d or getattr(neuron_config, "torch_dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
    if isinstance(d, str):
        d = getattr(torch, d.removeprefix("torch."), d)
    return d


class MiniMaxM3ForCausalLM(nn.Module):
    """The vLLM Neuron factory and model (see the module)."""

    def __init__(self, config: M3Config, layout: Layout):
        super().__init__()
        self.config, self.layout = config, layout
        self.plan = ShardPlan(world=layout.world, rank=layout.rank, ep=layout.ep, group=layout.group)
        self.plan.check(config)
        self.m3 = None  # the reference layers, built by load_weights
        self.cache: PagedCache | None = None
        self.aux_layers: tuple[int, ...] = ()  # EAGLE3 target states (vLLM's layer ids), none until a draft asks
        self.ods: sampling.OnDeviceSampling | None = None  # on-device sampling (the plugin's default), None: host

    @classmethod
    def from_configs(cls, hf_config, neuron_config) -> MiniMaxM3ForCausalLM:
        raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        c = M3Config.from_dict(raw, source="hf_config")
        world, rank, group = _tp_group()
        dcp, dcp_rank, dcp_group, speculative = _dcp(world)
        ep = getattr(neuron_config, "ep_degree", None) or 1
        check_serving(c, hf_config, Layout(world=world, rank=rank, ep=ep, group=group, dcp=dcp,
                                           speculative=speculative, dtype=_dtype(hf_config, neuron_config)),
                      neuron_config)
        layout = Layout(world=world, rank=rank, ep=ep, dtype=_dtype(hf_config, neuron_config),
                        tile=getattr(neuron_config, "attention_tile", None) or 256, group=group,
                        experts=QUANTIZATION[getattr(neuron_config, "quantization", None)], dcp=dcp,
                        dcp_rank=dcp_rank, dcp_group=dcp_group)
        model = cls(c, layout)
        model.ods = sampling.config(getattr(neuron_config, "on_device_sampling_config", None))
        return model

    # ---- caches -------------------------------------------------------------------------------------------------
    def get_kv_spec(self) -> KVSpec:
        c, dtype = self.config, self.layout.dtype
        kv = len(self.plan.kv_heads(c))
        layers = []
        for i in range(c.num_layers):
            layers.append(LayerSpec(attention_spec(i), kv, c.head_dim, dtype))
            if c.sparse_layers[i]:
                layers.append(LayerSpec(index_spec(i), 1, c.index_head_dim // 2, dtype))
        return KVSpec(layers=layers)

    def bind_kv_cache(self, kv_caches: dict) -> None:
        lay = self.layout
        dcp = (lay.dcp_rank, lay.dcp_group) if lay.dcp > 1 else None
        self.cache = PagedCache(self.config, kv_caches, lay.tile, lay.dtype, None if dcp else self.query_split(), dcp)

    def query_split(self):
        """The prefill index selection split over the ranks that hold this rank's KV head and index head
        (``parallel.kv_group_size``: consecutive ranks, ``ShardPlan.kv_heads``): this rank scores its share of a
        segment's queries and one all-gather over the TP group brings the group's shares (``ops.QuerySplit``); None
        when each rank holds its own heads."""
        parts = parallel.kv_group_size(self.config, self.layout.world)
        if parts == 1:
            return None
        first = self.layout.rank // parts * parts

        def gather(ids: torch.Tensor) -> torch.Tensor:
            b, h, n, k = ids.shape
            mine = self.plan.all_gather_stack(ids)[first:first + parts]  # [parts, B, H, T / parts, K]
            return mine.permute(1, 2, 0, 3, 4).reshape(b, h, parts * n, k)

        return ops.QuerySplit(parts, self.layout.rank % parts, gather)

    # ---- weights ------------------------------------------------------------------------------------------------
    def load_weights(self, checkpoint_path: str, device=None, cache_dir: str | None = None) -> None:
        """This rank's weights from a local checkpoint folder (any published format; ``s3://`` through
        ``minimax_m3.storage`` into ``cache_dir``)."""
        from ..storage import resolve  # boto3 only when an s3:// path asks for it

        path = resolve(checkpoint_path, cache_dir)
        self.m3 = load_model(path, device=device or "cpu", dtype=self.layout.dtype, config=self.config,
                             plan=self.plan)
        if self.layout.experts == "fp8":  # this rank's routed experts, after the load (a transient bf16 copy)
            from ..checkpoint.fp8_experts import quantize_experts_

            quantize_experts_(self.m3)
        self.fix_for_capture(device or "cpu")

    def fix_for_capture(self, device) -> None:
        """The choices a captured forward cannot make, made once the weights are in (outside any graph: the plugin's
        ``torch.compile`` captures the forward whole): the MoE's formulation — ``static`` (static shapes, no sort, no
        grouped matmul: what StableHLO can hold; per bucket, :func:`~minimax_m3.ops.moe.static_strategy`: each
        decode row with its expert's weights, or every local expert on every token, or rows in per-expert blocks,
        whichever computes least), never the host-side loop — its router's experts by descending score (the top-k
        torch-mlir lowers to StableHLO) — and the fused input projections (no data-pointer check in the graph)."""
        for layer in self.m3.layers:
            layer.attn.fix_projections()
            if hasattr(layer, "moe"):
                layer.moe.strategy = "static"
                layer.moe.ordered = True

    # ---- EAGLE3 target states (the plugin's SupportsEagle3 hooks) -------------------------------------------------
    def set_aux_hidden_state_layers(self, layers) -> None:
        """The layer ids whose input residual streams the draft reads (vLLM's indexing: id ``j`` enters layer
        ``j``); the forward then returns ``(logits, states [T, len(layers) x hidden])``."""
        self.aux_layers = tuple(sorted(int(i) for i in layers))

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """vLLM's default EAGLE3 taps: layers 2, n/2 and n-3."""
        n = self.config.num_layers
        return (2, n // 2, n - 3)

    # ---- forward ------------------------------------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: AOTAutograd fails on the in-place page writes of inference tensors
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds=None, is_token_ids=None,
                attn_metadata: dict | None = None, sampling_positions: torch.Tensor | None = None,
                sampling_params=None, spec_decode_metadata=None, logit_mask=None, rank=None, **kw) -> torch.Tensor:
        if self.m3 is None or self.cache is None:
            raise ServingError("forward before load_weights and bind_kv_cache: the runner calls both first")
        if inputs_embeds is not None:
            raise ServingError("prompt embeddings: MiniMax-M3's text backbone takes token ids only")
        meta = attn_metadata[attention_spec(0)]
        table = meta["block_table_tensor"]
        b, t = table.shape[0], input_ids.shape[0]
        if t % b:
            raise ServingError(f"{t} tokens do not split into the block table's {b} rows")
        # the runner's rule (a segment of a prompt: more tokens per row than a decode or verify step carries)
        prefill = meta.get("max_query_len", t // b) > meta.get("decode_token_threshold", 1)
        call = self.cache.call(meta["slot_mapping"].reshape(-1), table, prefill)
        ids, pos = input_ids.view(b, t // b).long(), positions.view(b, t // b).long()
        x, kept = self.m3.backbone(ids, pos, call, 0, False, self.aux_layers or None)
        x = x.reshape(t, -1)
        if sampling_positions is not None:
            x = x.index_select(0, sampling_positions.reshape(-1).long())
        logits = self.m3.logits(x)
        states = (torch.cat(kept, dim=-1).reshape(t, -1),) if self.aux_layers else ()
        if self.ods is None:  # host sampling: vLLM's sampler reads the logits
            return (logits, *states) if states else logits
        if spec_decode_metadata is not None and not prefill and t // b > 1:  # a verify step: the rejection here
            real = meta["slot_mapping"].reshape(b, t // b) >= int(meta["block_size"])  # page 0: the runner's padding
            tokens, last = sampling.verify(logits, input_ids.view(b, t // b), real, sampling_params, self.ods,
                                           logit_mask)
            return (tokens, *states, logits, last)
        tokens = sampling.sample(logits, sampling_params, self.ods, logit_mask)
        return (tokens, *states, logits)


__all__ = ["MiniMaxM3ForCausalLM"]
