"""vLLM general plugin: serve MiniMax-M3 through vllm-neuron (NxDI models on Trainium) without patching either.

vLLM calls :func:`register` in every process it starts (entry point ``vllm.general_plugins: minimax_m3``). With
vLLM and the Neuron SDK importable it

* registers the port with NxDI's ``MODEL_TYPES`` under ``"minimaxm3sparse"`` / ``"causal-lm"``, the key
  vllm-neuron derives from the release's architecture names (``MiniMaxM3SparseForConditionalGeneration`` and
  ``...ForCausalLM``: the part before "For", lowercased; ``ConditionalGeneration`` read as ``CausalLM``);
* registers the port's EAGLE3 draft (``neuron.eagle``) under ``"llama"`` / ``"causal-lm-eagle3"``, the key of the
  published drafts' architecture ``LlamaForCausalLMEagle3``, for ``--speculative-config`` (NxDI's fused speculation);
* registers those architectures with vLLM's ``ModelRegistry`` (:class:`VllmArchitectureStub`: vLLM only inspects
  it; vllm-neuron builds the NxDI model instead);
* makes both config.json forms loadable under the transformers vLLM pins (< 5, which has no ``minimax_m3_vl``):
  :class:`MiniMaxM3ServingConfig`, parsed by :class:`minimax_m3.config.M3Config`, exposes the text fields vLLM and
  vllm-neuron read (``num_key_value_heads``, ``head_dim``, ...) at top level and carries the parsed description
  as ``m3``, which NxDI's ``load_pretrained_config`` hands to the port's ``MiniMaxM3InferenceConfig``.

With vLLM alone (no SDK needed) it registers MiniMax-M3's tool-call and reasoning parsers as ``minimax_m3``
(:mod:`.parsers`) where vLLM has none that works. Without vLLM it does nothing (and imports neither vLLM nor the SDK);
without the SDK it registers nothing else. What vLLM may ask for that the port cannot do
(prefix caching, chunked prefill, speculation, buckets below --max-model-len, a bad TP/EP split) is refused when
vllm-neuron builds the NxDI config at start-up (:mod:`minimax_m3.neuron.config`), with the vLLM flag to change. A KV
connector never reaches that config, so :class:`VllmConfigChecks` refuses it earlier, when vLLM builds its own config
(vLLM's per-architecture hook ``MODELS_CONFIG_MAP``).
"""

from __future__ import annotations

import importlib.util
import logging

from torch import nn
from transformers import PretrainedConfig

from ...config.m3 import M3Config
from ...errors import ServingError

log = logging.getLogger(__name__)

ARCHITECTURES = ("MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3SparseForCausalLM")
NXDI_MODEL_KEY = ("minimaxm3sparse", "causal-lm")
# vllm-neuron's key of an EAGLE3 draft's architecture (LlamaForCausalLMEagle3): the port's fused-speculation draft
NXDI_DRAFT_KEY = ("llama", "causal-lm-eagle3")
# the text fields vLLM (and vllm-neuron's _get_model_configs) read at the config's top level
_TOP_LEVEL = {"hidden_size": "hidden_size", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
              "head_dim": "head_dim", "num_hidden_layers": "num_layers", "vocab_size": "vocab_size",
              "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
              "rope_theta": "rope_theta", "intermediate_size": "intermediate_size",
              "num_local_experts": "num_experts", "num_experts_per_tok": "top_k"}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def nxdi_model_types() -> dict | None:
    """NxDI's ``MODEL_TYPES`` (the dict vllm-neuron looks models up in), or None without the Neuron SDK."""
    try:
        from neuronx_distributed_inference.utils.constants import MODEL_TYPES as NXDI_MODELS
    except Exception:  # the SDK absent, or present but broken: serving cannot work either way
        return None
    return NXDI_MODELS


def register() -> None:
    """The entry point: registers everything above when vLLM and the Neuron SDK are importable, else nothing."""
    if not vllm_available():
        log.debug("minimax_m3 vLLM plugin: vLLM not importable, nothing registered")
        return
    register_chat_parsers()
    if nxdi_model_types() is None:
        log.info("minimax_m3 vLLM plugin: the Neuron SDK (NxDI) is not importable, the model is not registered")
        return
    register_config()
    register_architectures()
    register_config_checks()
    register_nxdi_model()


def register_chat_parsers() -> None:
    """M3's ``minimax_m3`` tool-call and reasoning parsers (:mod:`.parsers`), where vLLM has none that works. A
    failure is logged, not raised: the model still registers, and ``--tool-call-parser minimax_m3`` then fails at
    start-up naming the parser."""
    try:
        from .parsers import register_parsers

        register_parsers()
    except Exception as e:  # a vLLM whose parser interfaces moved: the model must still serve
        log.warning("minimax_m3 vLLM plugin: the minimax_m3 chat parsers were not registered (%s: %s)",
                    type(e).__name__, e)


def register_nxdi_model() -> None:
    from ..eagle import M3Eagle3DraftForCausalLM
    from ..model import NeuronMiniMaxM3ForCausalLM

    types = nxdi_model_types()
    model, task = NXDI_MODEL_KEY
    types.setdefault(model, {})[task] = NeuronMiniMaxM3ForCausalLM
    model, task = NXDI_DRAFT_KEY  # vllm-neuron resolves a draft by its architecture; NxDI has no EAGLE3 class
    types.setdefault(model, {}).setdefault(task, M3Eagle3DraftForCausalLM)


def register_architectures() -> None:
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, VllmArchitectureStub)


def register_config_checks() -> None:
    """:class:`VllmConfigChecks` as vLLM's config hook for the M3 architectures (``VllmConfig.__post_init__`` ->
    ``try_verify_and_update_config``: every process that builds a vLLM config, before any engine starts)."""
    try:
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    except ImportError:  # a vLLM without the hook: the connector then fails later, in vllm-neuron
        log.warning("minimax_m3 vLLM plugin: this vLLM has no MODELS_CONFIG_MAP; a KV connector is not refused")
        return
    for arch in ARCHITECTURES:
        MODELS_CONFIG_MAP.setdefault(arch, VllmConfigChecks)


class VllmConfigChecks:
    """What vLLM's own config asks for that the port cannot serve and that never reaches the neuron config
    vllm-neuron builds (:mod:`minimax_m3.neuron.config` refuses the rest there): a KV connector (disaggregated prefill
    or KV offloading). vllm-neuron's connector path hands the connector K/V pairs per layer; the port's caches add an
    index-K cache per sparse layer, which a connector would neither save nor restore."""

    @staticmethod
    def problems(vllm_config) -> list[str]:
        out = []
        kv = getattr(vllm_config, "kv_transfer_config", None)
        if kv is not None and getattr(kv, "kv_connector", None):
            out.append(f"a KV connector ({kv.kv_connector}): the port's sparse layers keep an index-K cache besides "
                       "K/V, which vllm-neuron's connector path does not move; remove --kv-transfer-config")
        backend = getattr(getattr(vllm_config, "cache_config", None), "kv_offloading_backend", None)
        if backend is not None:
            out.append(f"KV offloading ({backend}) is a KV connector (same reason); remove --kv-offloading-backend "
                       "and --kv-offloading-size")
        return out

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        problems = VllmConfigChecks.problems(vllm_config)
        if problems:
            raise ServingError(problems)
        from .structured import install

        install(vllm_config)  # structured outputs refused where this build would ignore their grammar


def register_config() -> None:
    """``AutoConfig`` learns the model types this transformers lacks (all of them below transformers 5)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for cls in CONFIG_CLASSES:
        if cls.model_type not in CONFIG_MAPPING:
            AutoConfig.register(cls.model_type, cls)


class MiniMaxM3ServingConfig(PretrainedConfig):
    """A release (nested ``text_config``) or transformers (flat) config.json, parsed by :class:`M3Config` and
    flattened for vLLM: the text fields at top level, the parsed description as ``m3`` (which NxDI's
    ``load_pretrained_config`` copies onto the NxDI config), no ``text_config`` (``get_text_config()`` is the
    config itself)."""

    model_type = "minimax_m3_vl"

    def __init__(self, m3: dict | None = None, **kwargs):
        if m3 is None and ("text_config" in kwargs or "hidden_size" in kwargs):
            raw = {k: v for k, v in kwargs.items() if k != "vision_config"}
            m3 = M3Config.from_dict(raw, source="config.json").fields_dict()
        super().__init__(**{k: v for k, v in kwargs.items() if k not in ("text_config", "vision_config")})
        self.m3 = m3
        if m3 is not None:
            c = M3Config.from_fields(m3)
            for name, field_name in _TOP_LEVEL.items():
                setattr(self, name, getattr(c, field_name))
            self.tie_word_embeddings = c.tie_word_embeddings


class MiniMaxM3TextServingConfig(MiniMaxM3ServingConfig):
    model_type = "minimax_m3_vl_text"


CONFIG_CLASSES = (MiniMaxM3ServingConfig, MiniMaxM3TextServingConfig)


class VllmArchitectureStub(nn.Module):
    """What vLLM's ``ModelRegistry`` inspects for the MiniMax-M3 architectures. vllm-neuron builds the NxDI model
    (``NeuronMiniMaxM3ForCausalLM``) itself; on any other platform vLLM would build this class, which refuses."""

    _MSG = ("MiniMax-M3 is served by vLLM through vllm-neuron (the Neuron platform) only; on other platforms use "
            "vLLM's own MiniMax-M3 support or this package's reference backend (see README, 'Serving with vLLM')")

    def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
        raise NotImplementedError(self._MSG)

    def embed_input_ids(self, input_ids):
        raise NotImplementedError(self._MSG)

    def forward(self, input_ids, positions):
        raise NotImplementedError(self._MSG)

    def compute_logits(self, hidden_states):
        raise NotImplementedError(self._MSG)
