"""NxDI configuration classes for MiniMax-M3 and its EAGLE3 draft, and their checks (imports NxDI: load only when the
neuron backend is used).

``MiniMaxM3InferenceConfig`` keeps the parsed model description as a plain dict ``m3`` (the fields of
:class:`minimax_m3.config.M3Config`) and derives every NxDI attribute from it in ``add_derived_config``, by
assignment only, so NxDI's reload from ``neuron_config.json`` (which calls the constructor again with the
already-derived values) gives the same config.

The fused EAGLE3 draft's (``neuron.eagle``): its config class :class:`M3Eagle3DraftConfig` (NxDI's Llama config),
its neuron config from the target's (:func:`draft_neuron_config`), its config from a parsed draft config
(:func:`draft_inference_config`), what NxDI's draft cannot run of a draft (:func:`draft_fit_problems`) and the target
layers it reads (:func:`aux_layers`). The ``FusedSpecNeuronConfig`` that names the draft's application class is
``build.fused_spec_config``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig, NeuronConfig
from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig
from neuronx_distributed_inference.modules.autobucketing import generate_buckets_for_tkg

from ..config import parallel
from ..config.draft import DraftConfig, default_aux_layers, parse_draft_config
from ..config.m3 import M3Config
from ..engine.buckets import bucket_problems, chunk_problems, context_buckets
from ..errors import ServingError
from .sampling import on_device_sampling_config

log = logging.getLogger(__name__)

_RAW_SKIP = ("neuron_config", "fused_spec_config", "metadata", "load_config")


class MiniMaxM3NeuronConfig(MoENeuronConfig):
    """``MoENeuronConfig`` with MiniMax-M3's SwiGLU-OAI expert activation as defaults.

    NxD computes ``gate * sigmoid(1.702 * gate) * (up + 1)`` with gate clamped above at 7 and up clamped to
    [-7, 7] when ``glu_type="swiglu"``, ``hidden_act="sigmoid"``, ``hidden_act_bias=1`` and the experts have
    (zero) biases; ``add_derived_config`` re-reads alpha and the limit from the model's config.json.

    ``prefill_all_logits`` (ours, default False): the context-encoding graph returns the logits of every
    position of its bucket instead of NxDI's last-token gather, so one prefill scores a whole prompt
    (``NeuronEngine.prefill_logits``); it costs a ``bucket x vocab`` fp32 output, so serving builds keep it off.

    ``prefill_chunk`` (ours; the engine spec's ``prefill_chunk``, vLLM: ``override_neuron_config``): a prompt wider
    than this is prefilled in successive context-encoding calls of at most this many tokens, each attending to the
    cache the earlier calls wrote (``NeuronMiniMaxM3ForCausalLM.forward`` runs the loop); the context buckets end at
    it. None: ``config.parallel.default_prefill_chunk`` of ``max_context_length`` (set by ``add_derived_config``)."""

    def __init__(self, **kwargs):
        problems = serving_problems(kwargs)
        if problems:
            raise ServingError(problems)
        self.prefill_all_logits = bool(kwargs.pop("prefill_all_logits", False))
        self.prefill_chunk = kwargs.pop("prefill_chunk", None)
        # vllm-neuron passes tp_degree only: the MoE split defaults to all TP ranks over moe_ep_degree groups
        tp, ep = kwargs.get("tp_degree", 1), kwargs.get("moe_ep_degree") or 1
        kwargs.setdefault("moe_tp_degree", parallel.moe_tp(tp, ep))
        kwargs.setdefault("glu_mlp", True)
        kwargs.setdefault("glu_type", "swiglu")
        kwargs.setdefault("hidden_act_scaling_factor", 1.702)
        kwargs.setdefault("hidden_act_bias", 1.0)
        kwargs.setdefault("gate_clamp_upper_limit", 7.0)
        kwargs.setdefault("gate_clamp_lower_limit", None)
        kwargs.setdefault("up_clamp_upper_limit", 7.0)
        kwargs.setdefault("up_clamp_lower_limit", -7.0)
        kwargs.setdefault("padding_side", "right")
        kwargs.setdefault("blockwise_matmul_config", dict(M3_BLOCKWISE))  # prefill MoE: see M3_BLOCKWISE
        super().__init__(**kwargs)


# What vllm-neuron's neuron config can ask for that this port does not do, each with the vLLM setting to change.
_NO_BLOCK_KV = ("the block KV layout is not supported (the index-K cache is one contiguous line per sequence, "
                "like K/V)")
UNSUPPORTED = (
    (lambda kw: kw.get("is_prefix_caching"),
     f"prefix caching: {_NO_BLOCK_KV}; serve with --no-enable-prefix-caching"),
    (lambda kw: kw.get("chunked_prefill_config") or kw.get("is_chunked_prefill"),
     f"chunked prefill: {_NO_BLOCK_KV}; leave --enable-chunked-prefill off and remove chunked_prefill_config from "
     "override_neuron_config"),
    (lambda kw: kw.get("is_block_kv_layout") and not (kw.get("is_prefix_caching") or kw.get("chunked_prefill_config")),
     f"is_block_kv_layout: {_NO_BLOCK_KV}; remove it from override_neuron_config"),
    (lambda kw: kw.get("medusa_speculation_length") or (
        (kw.get("enable_fused_speculation") or kw.get("enable_eagle_speculation"))
        and not (kw.get("enable_fused_speculation") and kw.get("enable_eagle_speculation") and kw.get("is_eagle3"))),
     "speculation other than fused EAGLE3 (Medusa, EAGLE-1/2, a plain draft model): not supported; the port runs "
     "an EAGLE3 draft (minimax-m3 --draft DIR [--fused-speculation]); remove --speculative-config (and the "
     "speculation fields of override_neuron_config)"),
)


def prefill_in_calls(nc) -> bool:
    """Whether a prompt may take several context-encoding calls (``prefill_chunk`` below ``max_context_length``):
    every call then reads what the earlier ones wrote (the target's attention, the fused draft's)."""
    return bool(nc.prefill_chunk) and nc.prefill_chunk < nc.max_context_length


def fused_neuron_config_problems(nc) -> list[str]:
    """What NxDI's fused EAGLE3 speculation (``neuron.eagle``) needs of the target's neuron config."""
    out = []
    if nc.kv_cache_tiling:
        out.append("kv_cache_tiling (NxDI turns it on for fused speculation): the port's caches are untiled "
                   "[rows, heads, positions, dim]; set disable_kv_cache_tiling=True")
    odsc = nc.on_device_sampling_config
    if odsc is None or odsc.do_sample:
        out.append("fused speculation needs on_device_sampling_config with do_sample=False (NxDI then keeps a draft "
                   "while it equals the target's token; the port's seeded sampler draws that token when dynamic=True)")
    return out


def serving_problems(kwargs: dict) -> list[str]:
    """What in a neuron config's keyword arguments (as vllm-neuron builds them) this port cannot serve."""
    return [message for test, message in UNSUPPORTED if test(kwargs)]


# Prefill MoE (NxD's forward_blockwise): the shard-on-intermediate dynamic-while NKI kernel, the one NxD's kernel
# gate accepts for SwiGLU with bias and clamps (modules/moe/blockwise.py:763-768) and to which forward_blockwise hands
# per-block "has a routed token" conditions (expert_mlps_v2.py:838-839), so only blocks holding routed tokens are
# computed; NxDI's Qwen3-MoE uses the same kernel (maybe_pad_intermediate). 256-token blocks: at EP 64 an expert gets
# T*k/128 tokens (256 at 8K), and a block reads its expert's weights once for B rows (B FLOP per weight byte), so
# B = 256 stays above trn2's ~125 FLOP/byte compute-to-HBM ratio. CPU mode keeps NxD's torch path (no kernel on CPU).
M3_BLOCKWISE = {"block_size": 256, "use_shard_on_intermediate_dynamic_while": True}


def m3_dict(c: M3Config) -> dict:
    """JSON-friendly field dict of an ``M3Config`` (tuples become lists)."""
    return c.fields_dict()


def config_hook(c: M3Config, path: str | Path):
    """An NxDI ``load_config`` hook handing NxDI the model's parsed config ``c`` (of the checkpoint at ``path``).

    transformers 4.57 (NxDI's pin) does not know ``minimax_m3_vl``, so NxDI's ``load_pretrained_config``
    cannot be used."""
    root = Path(path)

    def hook(cfg: InferenceConfig) -> None:
        cfg.m3 = m3_dict(c)
        cfg._name_or_path = str(root if root.is_dir() else root.parent)

    return hook


def load_m3_config(path: str | Path):
    """:func:`config_hook` of ``config.json`` at ``path`` (either form), read here: for callers that hand NxDI a
    path (vllm-neuron's loader through the plugin, tests); the engine passes the config it parsed."""
    return config_hook(M3Config.from_pretrained(path), path)


KV_LAYOUTS = parallel.KV_LAYOUTS


def kv_group_size(cfg) -> int:
    """G, the ranks sharing one KV head's caches: ``parallel.kv_group_size`` with the sharded layout (the default),
    else 1. The one home of this rule for a neuron config: the config sets ``num_cores_per_group`` from it (NxD builds
    the KV process group from that), the attention and the cache manager read it."""
    return parallel.kv_group_size(M3Config.from_fields(cfg.m3), cfg.neuron_config.tp_degree,
                                  getattr(cfg, "kv_layout", KV_LAYOUTS[0]))


def kv_layout_problems(cfg) -> list[str]:
    """What the KV-cache layout (``kv_layout``) needs of the config: one of :data:`KV_LAYOUTS`; with the sharded
    layout and G > 1, G divides the index block (every rank holds block/G keys of every block), every context bucket
    is a multiple of G (each rank writes its residue of a prefill call) and the cache length (``seq_len``) a whole
    multiple of lcm(block, G)."""
    nc, c = cfg.neuron_config, M3Config.from_fields(cfg.m3)
    if cfg.kv_layout not in KV_LAYOUTS:
        return [f"kv_layout {cfg.kv_layout!r}: choose one of {list(KV_LAYOUTS)}"]
    g = cfg.num_cores_per_group
    if g == 1:
        return []
    try:
        parallel.check_layout(c.index_block_size, g)
    except parallel.LayoutError as e:
        return [f"kv_layout 'sharded': {e.problems[0]}; or kv_layout 'replicated'"]
    out = []
    cte = nc.context_encoding_buckets if nc.enable_bucketing and nc.context_encoding_buckets else \
        [nc.max_context_length]
    if [b for b in cte if b % g]:
        out.append(f"kv_layout 'sharded' (G={g}): context-encoding buckets {sorted(cte)} must be multiples of {g}")
    unit = parallel.call_unit(c.index_block_size, g)
    if nc.seq_len % unit:
        out.append(f"kv_layout 'sharded' (G={g}): seq_len {nc.seq_len} must be a multiple of {unit} (lcm of the "
                   f"index block and G): e.g. {-(-nc.seq_len // unit) * unit}")
    return out


class MiniMaxM3InferenceConfig(InferenceConfig):
    def m3_config(self) -> M3Config:
        return M3Config.from_fields(self.m3)

    def add_derived_config(self):
        if not hasattr(self, "m3"):  # built from raw config.json keys (nested or flat) passed as kwargs
            raw = {k: v for k, v in vars(self).items() if k not in _RAW_SKIP}
            self.m3 = m3_dict(M3Config.from_dict(raw, source="MiniMaxM3InferenceConfig"))
        c = self.m3_config()
        self.hidden_size = c.hidden_size
        self.num_attention_heads = c.num_heads
        self.num_key_value_heads = c.num_kv_heads
        self.num_hidden_layers = c.num_layers
        self.head_dim = c.head_dim
        self.rotary_dim = c.rotary_dim
        self.vocab_size = c.vocab_size
        self.rms_norm_eps = c.rms_norm_eps
        self.rope_theta = c.rope_theta
        self.max_position_embeddings = c.max_position_embeddings
        self.num_local_experts = c.num_experts
        self.num_experts_per_tok = c.top_k
        self.intermediate_size = c.intermediate_size  # per routed expert: what NxD's ExpertMLPsV2 reads
        self.dense_intermediate_size = c.dense_intermediate_size
        self.shared_intermediate_size = c.shared_intermediate_size
        self.n_shared_experts = 0  # the shared expert is our own SwiGLU-OAI MLP, not NxD's SharedExperts
        self.routed_scaling_factor = c.routed_scaling_factor
        self.hidden_act = "sigmoid"  # NxD SWIGLU: gate * act(alpha * gate) * (up + bias)
        self.tie_word_embeddings = c.tie_word_embeddings
        self.pad_token_id = getattr(self, "pad_token_id", None) or 0
        self.bos_token_id, self.eos_token_id = c.bos_token_id, c.eos_token_id
        self.output_attentions, self.output_hidden_states, self.use_return_dict = False, False, True
        # the KV caches' layout (docs/long_context_port.md): "sharded" splits each KV head's K/V and index-K caches over
        # the G ranks that hold the head (token p on group rank p mod G); "replicated" keeps NxDI's GQA copies. NxD's
        # ModelBuilder builds the KV group from num_cores_per_group (flash_decoding_enabled stays off: the port's
        # attention and cache manager own the layout)
        self.kv_layout = getattr(self, "kv_layout", None) or KV_LAYOUTS[0]
        self.num_cores_per_group = kv_group_size(self)
        # speculative decoding with an EAGLE3 draft: the target layers whose input states the draft reads (vLLM's
        # ids), returned by every call as ``aux_states`` (``NeuronMiniMaxM3Model``)
        self.aux_hidden_layers = tuple(sorted(getattr(self, "aux_hidden_layers", None) or ()))

        nc = self.neuron_config
        nc.glu_mlp, nc.glu_type = True, "swiglu"
        nc.hidden_act_scaling_factor = c.swiglu_alpha
        nc.hidden_act_bias = 1.0
        nc.gate_clamp_upper_limit, nc.gate_clamp_lower_limit = c.swiglu_limit, None
        nc.up_clamp_upper_limit, nc.up_clamp_lower_limit = c.swiglu_limit, -c.swiglu_limit
        nc.router_config.act_fn = "sigmoid"
        nc.router_config.dtype = torch.float32
        nc.normalize_top_k_affinities = True
        nc.disable_numeric_cc_token = True
        if getattr(nc, "moe_fused_nki_kernel_enabled", None):
            log.warning("moe_fused_nki_kernel_enabled ignored: NxD's fused MoE decode kernel routes without "
                        "e_score_correction_bias and would change expert selection")
        nc.moe_fused_nki_kernel_enabled = False
        nc.blockwise_matmul_config.logical_nc_config = nc.logical_nc_config  # the kernel's LNC grid
        self.moe_fused_nki_kernel_enabled = False
        self._derive_prefill_chunk(c)

    def _derive_prefill_chunk(self, c: M3Config) -> None:
        """The prefill chunk (the engine spec's rule where none is given: vLLM's configs) and, where a prompt can be
        longer than it and no context buckets are given, the default buckets ending at it (as the spec's);
        ``self.prefill_chunk`` mirrors it (saved with the config)."""
        nc = self.neuron_config
        if nc.prefill_chunk is None:
            nc.prefill_chunk = parallel.default_prefill_chunk(c, nc.tp_degree, nc.max_context_length, self.kv_layout)
        if nc.enable_bucketing and not nc.context_encoding_buckets and 0 < nc.prefill_chunk < nc.max_context_length:
            nc.context_encoding_buckets = context_buckets(nc.prefill_chunk)
        self.prefill_chunk = nc.prefill_chunk

    def validate_config(self):
        super().validate_config()
        nc, c = self.neuron_config, self.m3_config()
        problems = []
        if nc.padding_side != "right":
            problems.append("padding_side must be 'right' (sparse blocks are anchored at absolute positions)")
        if nc.sequence_parallel_enabled and any(c.sparse_layers):
            problems.append("sequence_parallel_enabled would give the indexer a sequence shard; keep it off")
        if nc.is_continuous_batching and nc.ctx_batch_size != 1:
            problems.append(f"continuous batching prefills one sequence per call (NxDI writes one seq_id): set "
                            f"ctx_batch_size=1, not {nc.ctx_batch_size}")
        if nc.kv_cache_batch_size != nc.batch_size or nc.token_generation_batches:
            problems.append("kv_cache_batch_size != batch_size or token_generation_batches: decode writes cache "
                            "row r for batch row r (NxDI's rule when they are equal); keep kv_cache_batch_size = "
                            "batch_size and no decode batch buckets")
        if nc.flash_decoding_enabled or nc.attn_block_tkg_nki_kernel_enabled or nc.k_cache_transposed:
            problems.append("flash decoding / attn_block_tkg kernel / k_cache_transposed bypass the sparse "
                            "decode path; keep them off")
        problems += hybrid_sharding_problems(nc)
        if nc.cp_degree > 1 or nc.attention_dp_degree > 1:
            problems.append("cp_degree / attention_dp_degree > 1 are not supported by the sparse attention path")
        if nc.enable_fused_speculation:
            problems += fused_neuron_config_problems(nc)
        if nc.speculation_length and nc.async_mode:
            problems.append("speculation_length (a draft) with async mode: not yet; the host accepts each verify "
                            "step's drafts before the next")
        bad = [j for j in self.aux_hidden_layers if not 0 <= j < c.num_layers]
        if bad:
            problems.append(f"aux_hidden_layers {bad}: a target layer id in [0, {c.num_layers})")
        tp = nc.tp_degree
        problems += parallel.model_problems(c, tp, nc.moe_ep_degree)
        if not problems:
            problems += kv_layout_problems(self)
        # the buckets NxDI will build (its own when none are given; one of each length without bucketing)
        tkg = [b[-1] if isinstance(b, list) else b for b in generate_buckets_for_tkg(self)]
        cte = nc.context_encoding_buckets if nc.enable_bucketing else [nc.max_context_length]
        problems += bucket_problems(cte, tkg, nc.max_context_length, nc.seq_len, c, nc.prefill_chunk)
        problems += chunk_problems(nc.prefill_chunk, c, tp, max_context_len=nc.max_context_length,
                                   max_seq_len=nc.seq_len, kv_layout=self.kv_layout)
        if nc.moe_tp_degree * nc.moe_ep_degree != tp:
            problems.append(f"moe_tp_degree {nc.moe_tp_degree} x moe_ep_degree {nc.moe_ep_degree} must equal "
                            f"tp_degree {tp} (vLLM's --tensor-parallel-size)")
        if problems:  # NxDI asks for no exception type; ServingError keeps ValueError for vllm-neuron's loader,
            raise ServingError(problems)  # which catches (FileNotFoundError, ValueError) around a precompiled load

    def get_required_attributes(self):
        return ["m3", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "num_local_experts",
                "num_experts_per_tok", "intermediate_size"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MiniMaxM3NeuronConfig


# ---- the EAGLE3 draft's configs (fused speculation: neuron.eagle) ------------------------------------------------


def draft_fit_problems(dc: DraftConfig, target: M3Config) -> list[str]:
    """What NxDI's EAGLE3 draft cannot run of ``dc`` (its fixed layout: one layer, the residual before
    ``hidden_norm``, the target's hidden size)."""
    out = []
    if dc.num_layers != 1:
        out.append(f"a {dc.num_layers}-layer draft: NxDI's EAGLE3 draft has one decoder layer")
    if dc.norm_before_residual:
        out.append("norm_before_residual: NxDI's EAGLE3 draft adds the residual before hidden_norm; use the "
                   "reference backend or the host drafter (drop --fused-speculation)")
    if dc.hidden_size != target.hidden_size:
        out.append(f"draft hidden_size {dc.hidden_size} != the target's {target.hidden_size}: NxDI's EAGLE3 draft "
                   "feeds the target's states through an fc of its own width")
    return out


def draft_neuron_config(nc) -> NeuronConfig:
    """NxDI's neuron config of the draft inside a fused build whose target has neuron config ``nc`` (the port's own,
    or vllm-neuron's copy of it): the target's batch, lengths, buckets, dtype, TP and speculation length; greedy
    draft sampling (NxDI forces it); NxDI's EAGLE3 draft layer with its input norms; no KV tiling."""
    kw = dict(tp_degree=nc.tp_degree, batch_size=nc.batch_size, ctx_batch_size=nc.ctx_batch_size,
              tkg_batch_size=nc.tkg_batch_size, max_batch_size=nc.max_batch_size,
              is_continuous_batching=nc.is_continuous_batching, seq_len=nc.seq_len,
              max_context_length=nc.max_context_length, torch_dtype=nc.torch_dtype, padding_side="right",
              on_cpu=nc.on_cpu, enable_bucketing=nc.enable_bucketing,
              context_encoding_buckets=nc.context_encoding_buckets,
              token_generation_buckets=nc.token_generation_buckets, enable_eagle_speculation=True,
              is_eagle_draft=True, is_eagle3=True, enable_eagle_draft_input_norm=True,
              speculation_length=nc.speculation_length, disable_kv_cache_tiling=True,
              logical_nc_config=nc.logical_nc_config,
              on_device_sampling_config=on_device_sampling_config(do_sample=False))
    if nc.on_cpu:
        kw.update(attn_kernel_enabled=False, qkv_kernel_enabled=False, mlp_kernel_enabled=False)
    return NeuronConfig(**kw)


class M3Eagle3DraftConfig(LlamaInferenceConfig):
    """NxDI's Llama config of the draft; a neuron config that is not a plain ``NeuronConfig`` (vllm-neuron's copy
    of the target's, MoE fields and all) becomes :func:`draft_neuron_config`'s. ``draft_vocab_size`` defaults to the
    vocabulary; ``m3`` / ``target_path`` (the target's parsed config and checkpoint, for the shared tensors) are set
    by the port (``draft_inference_config``, or the target's loader under vLLM)."""

    def __init__(self, neuron_config, *args, **kwargs):
        if type(neuron_config) is not NeuronConfig:
            neuron_config = draft_neuron_config(neuron_config)
        super().__init__(neuron_config, *args, **kwargs)

    def add_derived_config(self):
        super().add_derived_config()
        self.draft_vocab_size = getattr(self, "draft_vocab_size", None) or self.vocab_size


def draft_inference_config(dc: DraftConfig, target_cfg, target_path: str):
    """The draft's config inside a fused build of ``target_cfg`` (the target's inference config, its checkpoint at
    ``target_path``, whose embedding and lm_head a draft may share)."""
    nc = target_cfg.neuron_config

    def load(cfg) -> None:
        fields = dict(hidden_size=dc.hidden_size, num_attention_heads=dc.num_heads,
                      num_key_value_heads=dc.num_kv_heads, head_dim=dc.head_dim, num_hidden_layers=dc.num_layers,
                      intermediate_size=dc.intermediate_size, vocab_size=dc.vocab_size,
                      draft_vocab_size=dc.draft_vocab_size, rms_norm_eps=dc.rms_norm_eps, rope_theta=dc.rope_theta,
                      rope_scaling=dc.rope_scaling, hidden_act=dc.hidden_act, pad_token_id=target_cfg.pad_token_id,
                      max_position_embeddings=max(nc.seq_len, 1), tie_word_embeddings=False, fc_bias=False,
                      m3=target_cfg.m3, target_path=str(target_path))
        for k, v in fields.items():
            setattr(cfg, k, v)

    return M3Eagle3DraftConfig(draft_neuron_config(nc), load_config=load)


def aux_layers(config) -> tuple[int, ...]:
    """The target layers a fused build's draft reads (vLLM's ids): the inference config's ``aux_hidden_layers`` (the
    port's builds), else the draft config's ``eagle_aux_hidden_state_layer_ids`` as vLLM reads them (vllm-neuron
    builds the draft config from its config.json), else vLLM's default."""
    if getattr(config, "aux_hidden_layers", None):
        return tuple(config.aux_hidden_layers)
    draft = config.fused_spec_config.draft_config
    raw = {k: v for k, v in vars(draft).items() if not k.startswith("_") and k != "neuron_config"}
    dc, _ = parse_draft_config(raw)
    return dc.aux_layers(config.num_hidden_layers) if dc is not None else \
        default_aux_layers(config.num_hidden_layers)


def hybrid_sharding_problems(nc) -> list[str]:
    """The one hybrid sharding the port builds (``--decode-experts tp``, ``parallel.decode_tp_experts``): prefill's
    experts as ``moe_tp_degree`` x ``moe_ep_degree``, decode's a copy over all ``tp_degree`` ranks in one group."""
    h = nc.hybrid_sharding_config
    if h is None:
        return []
    want = parallel.decode_tp_experts(nc.tp_degree, nc.moe_ep_degree)
    have = {k: getattr(h, k, None) for k in want}
    if have != want:
        return [f"hybrid_sharding_config {have}: the port builds only {want} (--decode-experts tp: prefill keeps "
                "the expert-parallel shards, decode reads a tensor-parallel copy over every rank)"]
    return []
