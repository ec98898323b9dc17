"""``NeuronMiniMaxM3Model`` (the traced graph) and ``NeuronMiniMaxM3ForCausalLM`` (NxDI application head)."""

from __future__ import annotations

import logging

import torch
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel
from neuronx_distributed_inference.models.model_wrapper import CONTEXT_ENCODING_MODEL_TAG, TOKEN_GENERATION_MODEL_TAG
from torch import nn

from ..checkpoint import CheckpointError, convert, fp8_experts
from ..checkpoint.nxdi_rules import fp32_targets
from . import nxd_compat
from .attention import NeuronMiniMaxM3Attention
from .chunk_loop import prefill_in_chunks
from .config import MiniMaxM3InferenceConfig
from .kv_cache import M3KVCacheManager
from .layers import GemmaNorm, SwiGLUOAIMLP
from .rank_files import unfilled_parameters
from .sampling import SeededModelWrapper, SeededSampler, create_m3_sampler, validate, widen
from .moe import attach_shared_expert, initialize_m3_moe_module

log = logging.getLogger(__name__)


class NeuronMiniMaxM3DecoderLayer(nn.Module):
    def __init__(self, config: MiniMaxM3InferenceConfig, layer_idx: int):
        super().__init__()
        c = config.m3_config()
        dtype = config.neuron_config.torch_dtype
        self.input_layernorm = GemmaNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = GemmaNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = NeuronMiniMaxM3Attention(config, layer_idx)
        self.is_moe = bool(c.moe_layers[layer_idx])
        if self.is_moe:
            # one all-reduce per MoE layer: the routed experts' down projection carries routed_scaling_factor
            # (folded by the converter, checkpoint/nxdi_rules.py) and the shared expert hands its partial sums to
            # the MoE, which adds them before its single reduction (in the activations' dtype)
            self.moe = initialize_m3_moe_module(config)
            self.shared_expert = SwiGLUOAIMLP(c.hidden_size, c.shared_intermediate_size, c.swiglu_alpha,
                                              c.swiglu_limit, dtype, reduce_output=False)
            attach_shared_expert(self.moe, self.shared_expert)
        else:
            self.mlp = SwiGLUOAIMLP(c.hidden_size, c.dense_intermediate_size, c.swiglu_alpha, c.swiglu_limit, dtype,
                                    reduce_dtype=config.neuron_config.rpl_reduce_dtype)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                padding_mask=None, **kwargs):
        residual = hidden_states
        out = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                             position_ids=position_ids, past_key_value=past_key_value, **kwargs)
        hidden_states = residual + out.hidden_states
        h = self.post_attention_layernorm(hidden_states)
        if self.is_moe:
            mlp_out = self.moe(h, padding_mask)[0]
        else:
            mlp_out = self.mlp(h)
        return (hidden_states + mlp_out, out.present_key_value, out.cos_cache, out.sin_cache, None)


RULES = "minimax_m3/checkpoint/nxdi_rules.py"
class NeuronMiniMaxM3Model(nxd_compat.OnDeviceSamplingHook, NeuronBaseModel):
    def setup_attr_for_model(self, config: MiniMaxM3InferenceConfig):
        nc = config.neuron_config
        self.on_device_sampling = nc.on_device_sampling_config is not None
        self.tp_degree = nc.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_batch_size = nc.max_batch_size
        self.buckets = nc.buckets

    def init_model(self, config: MiniMaxM3InferenceConfig):
        c = config.m3_config()
        dtype = config.neuron_config.torch_dtype
        self.padding_idx = config.pad_token_id
        self.vocab_size = c.vocab_size
        self.embed_tokens = ParallelEmbedding(c.vocab_size, c.hidden_size, self.padding_idx, dtype=dtype,
                                              shard_across_embedding=True)
        self.layers = nn.ModuleList(NeuronMiniMaxM3DecoderLayer(config, i) for i in range(c.num_layers))
        self.norm = GemmaNorm(c.hidden_size, c.rms_norm_eps)
        # keep_padded_output: NxD pads the vocabulary to a multiple of TP, and NxDI's forward masks the last
        # ``pad_size`` columns of the (gathered) logits; trimmed here, that mask would hit the last real tokens.
        # As NxDI's gpt-oss / llama4: keep the padded width, the application head slices it off.
        self.lm_head = ColumnParallelLinear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype,
                                            gather_output=not self.on_device_sampling, pad=True,
                                            keep_padded_output=True)
        # a draft's target states (EAGLE3): the residual stream entering each of these layers, every position of
        # the call, concatenated in ascending order as one more output after the caches (``aux_states``)
        self.aux_layers = tuple(sorted(getattr(config, "aux_hidden_layers", None) or ()))
        if config.neuron_config.is_eagle3 and getattr(config, "fused_spec_config", None) is not None:
            from .config import aux_layers  # a fused build vllm-neuron configured: the draft's config.json ids

            self.aux_layers = tuple(sorted(aux_layers(config)))
        self._aux = {}
        for j in self.aux_layers:
            self.layers[j].register_forward_pre_hook(self._keep_aux(j), with_kwargs=True)

    def _keep_aux(self, j: int):
        def hook(module, args, kwargs):
            self._aux[j] = args[0] if args else kwargs["hidden_states"]

        return hook

    def forward(self, input_ids, attention_mask, position_ids, *args, **kwargs):
        """NxDI's forward, with the prefill's last real token found from the attention mask (see
        :meth:`get_model_output`)."""
        self._last_real, self._positions, self._mask = None, position_ids, attention_mask
        if attention_mask.dim() == 2 and nxd_compat.is_context_encoding(self, input_ids) \
                and not self.config.neuron_config.prefill_all_logits:
            # right padding: the last real token of a row is its mask's length - 1. NxDI infers a width-0 mask
            # for a one-token prompt without one (vllm-neuron passes none), hence at least one token.
            self._last_real = attention_mask.sum(dim=1).clamp(min=1) - 1
        outputs = super().forward(input_ids, attention_mask, position_ids, *args, **kwargs)
        if self.aux_layers and not self.neuron_config.enable_eagle_speculation:  # after the caches (NxDI's cache
            # aliasing counts from the front); in fused speculation NxDI's own EAGLE3 outputs carry them
            outputs = list(outputs) + [torch.cat([self._aux.pop(j) for j in self.aux_layers], dim=-1)]
        return outputs

    def get_model_output(self, *args, **kwargs):
        """NxDI picks the prefill's last token by the largest position, but pads positions with 1, so a one-token
        prompt (position 0) would get a padding slot's logits; the row's last real token is gathered here and
        NxDI's own gather skipped (``sliced_hidden``, as after its sequence-parallel gather)."""
        hidden, cache = super().get_model_output(*args, **kwargs)
        if self.neuron_config.is_eagle3 and self.aux_layers:
            hidden = self.eagle3_states(hidden)
        last = getattr(self, "_last_real", None)
        if last is not None and kwargs.get("is_for_context_encoding") and hidden.shape[1] > 1:
            index = last.to(torch.long).view(-1, 1, 1).expand(hidden.shape[0], 1, hidden.shape[2])
            hidden = torch.gather(hidden, dim=1, index=index)
            self.sliced_hidden = True
        return hidden, cache

    def eagle3_states(self, hidden):
        """NxDI's EAGLE3 target layout ``[B, S, 4H]`` (the three draft states, then the normed final state;
        ``full_hidden_states`` the first three) with the states of the draft's own aux layer ids, which NxDI fixes
        at the outputs of layers ``1, L // 2 - 1, L - 4`` (``NeuronBaseModel.get_model_output``, NxDI 0.9): the
        residual stream entering each of ``self.aux_layers`` (vLLM's ids; equal to NxDI's for its default)."""
        states = torch.cat([self._aux.pop(j) for j in self.aux_layers], dim=-1)
        self.full_hidden_states = states
        return torch.cat([states, hidden[..., -self.hidden_size:]], dim=-1)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """NxDI's CPU mode loads the sharded state dict with ``strict=False`` (after NxD's preshard hooks and
        removal of keys the model lacks), which would leave any parameter the converter misnamed at its random
        initialisation: every such parameter is named in one error first."""
        missing = unfilled_parameters(self, state_dict.keys())
        if missing:
            raise CheckpointError([f"{k}: a parameter of the NxDI model that the converted state dict does not fill"
                                   for k in missing], source=f"converted state dict (rule table: {RULES})")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def init_inference_optimization(self, config: MiniMaxM3InferenceConfig):
        """As NxDI's, with the index-K cache added to the aliased cache list."""
        if self.on_device_sampling:
            tp = self.lm_head.tensor_parallel_group.size() if hasattr(self.lm_head, "tensor_parallel_group") else None
            self.sampler = create_m3_sampler(config.neuron_config, tp)
        self.kv_mgr = M3KVCacheManager(config, num_kv_head=self.num_key_value_heads, global_rank=self.rank_util)

    def sample_on_device(self, logits, sampling_params, is_for_context_encoding):
        """The seeded sampler given each row's counter: the position of the token it samples after (the prefill's
        last real token, or the decode token's position), and that row's logits; None (NxDI's own step) for another
        sampler. A speculative verify step (``speculation_length`` positions per row) draws at every position, each
        at its own counter: ``[B, k + 1]`` token ids, the ones plain decoding would choose after each token. Called
        for NxDI's sampling step by ``nxd_compat.OnDeviceSamplingHook``."""
        if not isinstance(self.sampler, SeededSampler):
            return None
        if not is_for_context_encoding and logits.shape[1] > 1:  # verify: every position at its own counter
            b, t, v = logits.shape
            ids = self.sampler(logits.reshape(b * t, v), sampling_params.repeat_interleave(t, dim=0),
                               rank_id=self.rank_util.get_rank(), positions=self._positions.reshape(-1))
            return ids.reshape(b, t).to(torch.int32)
        counter, last = self._positions.max(dim=1).values, None
        if is_for_context_encoding and self._last_real is not None:
            last = self._last_real
        elif is_for_context_encoding and self._mask is not None and self._mask.dim() == 2:
            last = self._mask.sum(dim=1).clamp(min=1) - 1  # right padding: the last real token (all-logits builds)
        if last is not None:  # its position, not its index: a chunk of a chunked prefill starts at p0 > 0
            last = last.to(torch.long).view(-1, 1)
            counter = torch.gather(self._positions, 1, last)[:, 0]
        if logits.shape[1] > 1:  # all-position prefill logits: the last real token's column
            at = last if last is not None else counter.to(torch.long).view(-1, 1)
            row = torch.gather(logits, 1, at.view(-1, 1, 1).expand(-1, 1, logits.shape[2]))[:, 0]
        else:
            row = logits[:, -1, :]
        return self.sampler(row, sampling_params, rank_id=self.rank_util.get_rank(), positions=counter).to(torch.int32)


def stream_state_dict(path, config: MiniMaxM3InferenceConfig) -> dict:
    """The NxDI state dict of the checkpoint at ``path`` (any published format), through the checkpoint
    package's one rule engine: validated first (every problem in one error), converted one rule at a time (only
    the current rule's release tensors are materialised besides the output), in the model dtype except the fp32
    keys (folded norms, router weight and bias)."""
    return dict(stream_pairs(path, config))


def stream_pairs(path, config: MiniMaxM3InferenceConfig):
    """The ``(name, tensor)`` stream behind :func:`stream_state_dict`, one rule's tensors at a time, unit by unit
    (the global tensors, then each layer): what ``neuron.rank_files.write_sharded`` shards without holding it all."""
    nc = config.neuron_config
    pairs = convert.stream_state_dict(path, to="neuron", dtype=nc.torch_dtype, tp=nc.tp_degree,
                                      config=config.m3_config(), fused_qkv=nc.fused_qkv)
    if not nc.quantized:
        return pairs
    if nc.quantization_type != fp8_experts.QUANTIZATION_TYPE or nc.quantization_dtype != fp8_experts.QUANTIZATION_DTYPE:
        raise CheckpointError([f"quantization {nc.quantization_type}/{nc.quantization_dtype}: the port writes routed "
                               "experts as expert_wise_per_channel_symmetric/f8e4m3 only; use "
                               "checkpoint.fp8_experts.neuron_config_kwargs()"], source="neuron config")
    pairs = fp8_experts.quantize_pairs(pairs)  # e4m3 routed experts plus their .scale keys
    if nc.hybrid_sharding_config is not None:  # --decode-experts tp: the decode copy's scales (NxD copies the rest)
        pairs = nxd_compat.hybrid_expert_scales(pairs)
    return pairs


class NeuronMiniMaxM3ForCausalLM(nxd_compat.SpeculationOutputs, NeuronBaseForCausalLM):
    _model_cls = NeuronMiniMaxM3Model

    @classmethod
    def get_config_cls(cls):
        return MiniMaxM3InferenceConfig

    @staticmethod
    def load_hf_model(model_path, **kwargs):
        raise NotImplementedError("MiniMax-M3 weights are read from safetensors by minimax_m3.checkpoint")

    @classmethod
    def get_state_dict(cls, model_name_or_path: str, config: MiniMaxM3InferenceConfig) -> dict:
        return stream_state_dict(model_name_or_path, config)

    @classmethod
    def get_state_dict_stream(cls, model_name_or_path: str, config: MiniMaxM3InferenceConfig):
        """:meth:`get_state_dict` as a stream of ``(name, tensor)``, unit by unit (``neuron.rank_files``)."""
        return stream_pairs(model_name_or_path, config)

    def get_model_wrapper_cls(self):
        return SeededModelWrapper if self.neuron_config.on_device_sampling_config else super().get_model_wrapper_cls()

    def validate_sampling_params(self, params: torch.Tensor) -> None:
        if self.neuron_config.on_device_sampling_config:
            validate(params, self.neuron_config.on_device_sampling_config)

    def preprocess_inputs(self, *args, sampling_params=None, **kwargs):
        """NxDI's, with on-device sampling's three-column sampling params (or NxDI's defaults) given seed 0
        (``neuron.sampling.widen``) before NxDI validates them."""
        if self.neuron_config.on_device_sampling_config:
            sampling_params = widen(sampling_params, self.default_sampling_params)
        return super().preprocess_inputs(*args, sampling_params=sampling_params, **kwargs)

    def _is_prefill(self, position_ids):
        """NxDI sends a call to the context-encoding graph when its positions start at 0; a call of a chunked
        prefill starts at ``p0 > 0`` and is one too: any call wider than one token that is not a speculative verify
        step (``speculation_length`` wide; the chunk loop never sends a chunk that wide). Targets NxDI 0.9
        (``models/model_base.py``: ``NeuronBaseForCausalLM._is_prefill``, private; the synchronous and the async
        paths both route by it)."""
        width = position_ids.shape[-1]
        return width > 1 and width != self.neuron_config.speculation_length or super()._is_prefill(position_ids)

    def forward(self, *args, **kwargs):
        """NxDI's forward, in calls of at most ``prefill_chunk`` tokens when a prefill is wider
        (``chunk_loop.prefill_in_chunks``: the one chunk loop, for the engine's provider and vllm-neuron, which hands
        the model whole prompts), with the LM head's vocabulary padding (a multiple of TP, masked) sliced off."""
        kwargs.update(nxd_compat.forward_kwargs(args))
        pos = kwargs.get("position_ids")
        if kwargs.get("attention_mask") is None and pos is not None and self._is_prefill(pos):
            kwargs["attention_mask"] = nxd_compat.infer_attention_mask(self, pos)  # vllm-neuron's prefills: no mask
        out = prefill_in_chunks(self, super().forward, kwargs)
        vocab = self.config.vocab_size
        if getattr(out, "logits", None) is not None and out.logits.shape[-1] > vocab:
            out.logits = out.logits[..., :vocab]
        return out

    def shard_weights(self, compiled_model_path, debug=False, pre_shard_weights_hook=None):
        """NxDI's pre-sharding (``save_sharded_checkpoint``), streamed: ``neuron.rank_files.write_sharded`` writes the
        same rank files one layer at a time instead of NxD's whole state dict plus every rank's shard in memory.
        NxDI's own path where it does more than shard (LoRA, the layout-transformation option) or is skipped."""
        import os

        nc = self.neuron_config
        if nc.skip_sharding or not nc.save_sharded_checkpoint or nc.lora_config is not None \
                or nc.enable_fused_speculation or nxd_compat.layout_transformation_requested():
            return super().shard_weights(compiled_model_path, debug, pre_shard_weights_hook)
        from .rank_files import write_sharded

        if pre_shard_weights_hook:
            pre_shard_weights_hook(self)
        write_sharded(self, os.path.join(str(compiled_model_path), "weights"))

    def checkpoint_loader_fn(self, mmap: bool = False):
        """NxDI's loader casts every float tensor to the model dtype; ours keeps the fp32 keys (folded norms,
        router weight, routing bias) float32 and casts the rest in the converter."""
        sd = self.get_state_dict(nxd_compat.checkpoint_path(self), self.config)
        keep = fp32_targets(self.config.m3_config(), self.neuron_config.tp_degree)
        bad = sorted(k for k in keep if k in sd and sd[k].dtype != torch.float32)
        if bad:
            raise CheckpointError([f"{k}: {sd[k].dtype}, must stay float32 (keep_fp32 in the rule table)"
                                   for k in bad], source=f"converted state dict (rule table: {RULES})")
        if self.neuron_config.enable_fused_speculation:  # the draft's keys too, each model under its prefix
            fused = self.config.fused_spec_config
            for name, value in (("m3", self.config.m3), ("target_path", nxd_compat.checkpoint_path(self))):
                if not getattr(fused.draft_config, name, None):  # vllm-neuron's draft config: from config.json only
                    setattr(fused.draft_config, name, value)
            sd = nxd_compat.fused_state_dict(fused, sd)
        return sd

    # Per-submodel compiler arguments as NxDI's Qwen3-MoE sets them (models/qwen3_moe/modeling_qwen3_moe.py:503-543,
    # NxDI 4bcdc54): ``compile_tag`` is set just before NxDI's enable_* builds each ModelWrapper (model_base.py
    # enable_context_encoding / enable_token_generation call get_compiler_args() there).
    def enable_context_encoding(self, **kwargs):
        self.compile_tag = CONTEXT_ENCODING_MODEL_TAG
        if self.neuron_config.enable_fused_speculation:  # NxDI's __init__ has just set its NeuronFusedSpecModel
            from .eagle import M3FusedSpecModel  # (the draft follows a prompt prefilled in several calls)

            self._model_cls = M3FusedSpecModel
        super().enable_context_encoding(**kwargs)

    def enable_token_generation(self, *args, **kwargs):
        self.compile_tag = TOKEN_GENERATION_MODEL_TAG
        super().enable_token_generation(*args, **kwargs)

    def get_compiler_args(self):
        """Context encoding ``-O1`` (modular flow); token generation ``-O3`` with expert parallelism ("Disable
        Modular flow for TKG graph with EP enabled as it causes perf degradation", qwen3_moe:518-519), else
        ``-O1``. The rest as Qwen3-MoE; NxDI's ModelWrapper appends ``--verify-hlo=true`` itself
        (model_wrapper.py:159-162)."""
        nc = self.neuron_config
        tkg = getattr(self, "compile_tag", None) == TOKEN_GENERATION_MODEL_TAG
        opt = "-O3" if tkg and nc.moe_ep_degree > 1 else "-O1"
        args = (f"--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer {opt}"
                " --tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2'"
                " --auto-cast=none --internal-enable-dge-levels vector_dynamic_offsets"
                f" --lnc={nc.logical_nc_config}")
        if self.neuron_config.scratchpad_page_size:
            args += f" --hbm-scratchpad-page-size={self.neuron_config.scratchpad_page_size}"
        return args


class AllPositionsModel(NeuronMiniMaxM3Model):
    """The traced model of a ``prefill_all_logits`` build: NxDI's ``NeuronBaseModel.forward`` gathers the last
    real token's hidden state before the LM head unless ``sliced_hidden`` says a sequence-parallel gather already
    did; set from the start, the LM head runs on every position of the bucket (one position in decode, as
    before)."""

    def __init__(self, config, optimize_inference: bool = True):
        super().__init__(config, optimize_inference)
        self.sliced_hidden = True


class AllPositionsForCausalLM(NeuronMiniMaxM3ForCausalLM):
    _model_cls = AllPositionsModel
