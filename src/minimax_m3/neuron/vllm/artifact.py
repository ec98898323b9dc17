"""``minimax-m3 compile --for-vllm``: compile once, serve many times through vLLM + vllm-neuron 0.4.1.

vllm-neuron loads precompiled artifacts only from ``$NEURON_COMPILED_ARTIFACTS`` (without it, it compiles into
``<model>/neuron-compiled-artifacts/<hash>`` and deletes that directory at the next start). Its load branch
(``_load_weights_common`` -> ``_load_compiled_model``) is ``NeuronMiniMaxM3ForCausalLM(dir).load(dir)``: the NxDI
config comes from ``dir/neuron_config.json`` (``override_neuron_config`` is then ignored), the NEFFs from
``dir/model.pt`` and, with ``save_sharded_checkpoint``, the weights from ``dir/weights/tp{r}_sharded_checkpoint
.safetensors`` (without it NxDI would shard from the model path, which is ``dir`` there: no checkpoint).

So the artifact is NxDI's ``compile()`` of the config vllm-neuron itself builds for the serving command line:
:func:`minimax_m3.neuron.vllm.defaults.vllm_neuron_config` (vllm-neuron's own functions when importable) with an
``override_neuron_config`` taken from the engine's translation of the same spec (:func:`serving_override`: the
layout fields vllm-neuron leaves to the override), and NxDI's ``load_pretrained_config`` as vllm-neuron calls it.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time

from ...config.m3 import M3Config
from ...engine.spec import EngineSpec, SpecError

# the engine's NxDI fields vllm-neuron does not set itself (the rest it derives from the vLLM flags)
OVERRIDE_FIELDS = ("moe_ep_degree", "logical_nc_config", "context_encoding_buckets", "token_generation_buckets",
                   "attn_kernel_enabled", "qkv_kernel_enabled", "mlp_kernel_enabled", "save_sharded_checkpoint",
                   "on_cpu", "blockwise_matmul_config", "quantized", "quantization_type", "quantization_dtype",
                   "quantized_checkpoints_path", "modules_to_not_convert", "prefill_chunk", "is_eagle3",
                   "disable_kv_cache_tiling", "hybrid_sharding_config")


def serving_problems(spec: EngineSpec) -> list[str]:
    """What in a resolved spec vllm-neuron would build differently (one problem per option)."""
    out = []
    if spec.all_logits:
        out.append("--all-logits: vLLM reads each request's last position only; drop it (or --no-all-logits)")
    if spec.continuous_batching != (spec.max_batch > 1):
        out.append(f"--continuous-batching {spec.continuous_batching}: vllm-neuron batches continuously exactly when "
                   "--max-num-seqs (--batch) > 1; drop the option")
    if spec.max_context_len != spec.max_seq_len:
        out.append(f"--max-context-len {spec.max_context_len}: vllm-neuron sets the longest prompt to --max-model-len "
                   f"(--max-seq-len {spec.max_seq_len}); drop --max-context-len")
    if spec.kv_layout != "sharded":
        out.append(f"--kv-layout {spec.kv_layout}: vllm-neuron builds the model's config itself and "
                   "override_neuron_config carries neuron-config fields only, so it serves the default sharded "
                   "caches; drop --kv-layout (the replicated layout is served by `minimax-m3 generate`/`compile` "
                   "with --backend neuron)")
    if spec.draft and not spec.fused_speculation:
        out.append("--draft without --fused-speculation: vllm-neuron serves a draft only through NxDI's fused "
                   "speculation (docs/speculative.md); add --fused-speculation --on-device-sampling")
    return out


def vllm_spec(spec: EngineSpec, config: M3Config | None, structured_outputs: bool = False) -> EngineSpec:
    """compile's spec for serving (``--all-logits`` off unless asked; ``--compiled`` is the output directory, not
    part of the spec), resolved and validated with the serving rules: one error listing every problem."""
    # the directory is where the artifact goes, also in CPU mode (the config only); serving builds no all-logits
    spec = dataclasses.replace(spec, compiled=None, all_logits=False if spec.all_logits is None else spec.all_logits)
    problems = spec.problems(config) + serving_problems(spec.resolve(config))
    if structured_outputs and spec.fused_speculation:
        problems.append("--structured-outputs with --fused-speculation: NxDI's fused speculation accepts drafts on "
                        "the device, where vLLM's grammar never applies; drop one of them")
    if problems:
        raise SpecError(problems, source="compile --for-vllm")
    return spec.resolve(config)


def _json_form(nc) -> dict:
    from neuronx_distributed_inference.models.config import to_dict

    return json.loads(json.dumps(to_dict(nc)))


def serving_override(spec: EngineSpec) -> dict:
    """The ``override_neuron_config`` that makes vllm-neuron's neuron config carry the engine's layout for
    ``spec``: each of :data:`OVERRIDE_FIELDS` where the engine's value (``neuron.engine.neuron_config``) differs
    from what vllm-neuron's defaults give (of a nested config, the fields that differ)."""
    from ..build import neuron_config
    from ..config import MiniMaxM3NeuronConfig
    from .defaults import vllm_neuron_config

    engine = _json_form(neuron_config(spec))
    # (vllm-neuron's own fields of a fused build are refused without the EAGLE3 switches: compared without them)
    plain = _json_form(MiniMaxM3NeuronConfig(**vllm_neuron_config(**{**_flags(spec), "speculative_tokens": None},
                                                                  override={})))
    out = {}
    for k in OVERRIDE_FIELDS:
        mine, theirs = engine.get(k), plain.get(k)
        if k not in engine or mine == theirs:
            continue
        if isinstance(mine, dict) and isinstance(theirs, dict):  # e.g. blockwise_matmul_config: the fields that differ
            mine = {f: v for f, v in mine.items() if v != theirs.get(f)}
        out[k] = mine
    return out


def _flags(spec: EngineSpec) -> dict:
    return dict(tp=spec.tp, max_num_seqs=spec.max_batch, max_model_len=spec.max_seq_len, dtype=spec.dtype,
                speculative_tokens=_vllm_speculative_tokens(spec))


def _vllm_speculative_tokens(spec: EngineSpec) -> int | None:
    """vLLM's ``num_speculative_tokens`` for a fused spec: vllm-neuron hands it to NxDI as ``speculation_length``
    (drafts + 1)."""
    return spec.num_speculative_tokens + 1 if spec.fused_speculation else None


def vllm_inference_config(spec: EngineSpec, override: dict):
    """The NxDI config vllm-neuron builds for ``spec``'s ``vllm serve`` command line (see module doc)."""
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    from . import plugin as vllm_plugin
    from ..config import MiniMaxM3InferenceConfig
    from .defaults import vllm_neuron_config

    vllm_plugin.register_config()  # what the plugin does in vLLM's processes: config.json through AutoConfig
    kw = vllm_neuron_config(**_flags(spec), override=override)
    cls = MiniMaxM3InferenceConfig
    cfg = cls(cls.get_neuron_config_cls()(**kw), load_config=load_pretrained_config(spec.model))  # ServingError
    if spec.fused_speculation:  # as vllm-neuron's _init_fused_spec_config (no draft_overrides)
        from ..build import vllm_fused_spec_config
        from ..model import NeuronMiniMaxM3Model

        cfg.fused_spec_config = vllm_fused_spec_config(cfg, spec.draft, NeuronMiniMaxM3Model)
    return cfg


# M3's chat format read by the package's parsers (neuron/vllm/parsers.py): tool calls and thinking apart from content
PARSER_FLAGS = "--enable-auto-tool-choice --tool-call-parser minimax_m3 --reasoning-parser minimax_m3"


def serve_command(spec: EngineSpec, override: dict, path: str, name: str = "minimax-m3") -> str:
    """The ``vllm serve`` command line that loads ``path`` (and would build the same config)."""
    return (f"export NEURON_COMPILED_ARTIFACTS={shlex.quote(str(path))}\n"
            f"vllm serve {shlex.quote(str(spec.model))} --served-model-name {name} --dtype {spec.dtype} "
            f"--tensor-parallel-size {spec.tp} --max-model-len {spec.max_seq_len} --max-num-seqs {spec.max_batch} "
            f"--no-enable-prefix-caching {PARSER_FLAGS} --additional-config "
            f"{shlex.quote(json.dumps({'override_neuron_config': override}))}" + _speculative_flag(spec))


def _speculative_flag(spec: EngineSpec) -> str:
    if not spec.fused_speculation:
        return ""
    cfg = {"method": "eagle", "model": str(spec.draft), "num_speculative_tokens": _vllm_speculative_tokens(spec)}
    return f" --speculative-config {shlex.quote(json.dumps(cfg))}"


def compile_for_vllm(spec: EngineSpec, compiled: str | None = None, structured_outputs: bool = False) -> int:
    """NxDI's compile of vllm-neuron's config for the serving ``spec`` (:func:`vllm_spec`) into ``compiled``
    (default: the spec's directory + ``-vllm``); in CPU mode (``--backend neuron-cpu``: no NEFFs) only the config,
    for the off-device test. ``structured_outputs``: sampling on the host, where vLLM applies structured outputs'
    grammar (:mod:`.structured`); else vllm-neuron's on-device sampling, and the server refuses them."""
    from ..model import NeuronMiniMaxM3ForCausalLM
    from .structured import HOST_SAMPLING

    override = {**serving_override(spec), **(HOST_SAMPLING if structured_outputs else {})}
    cfg = vllm_inference_config(spec, override)
    path = compiled or spec.artifact_dir() + "-vllm"
    t0 = time.perf_counter()
    if spec.backend == "neuron":
        NeuronMiniMaxM3ForCausalLM(spec.model, cfg).compile(path)
    else:
        cfg.save(path)  # what compile() writes first; CPU mode compiles no NEFFs
    spec.write_artifact(path, for_vllm=True)
    what = "compiled" if spec.backend == "neuron" else "wrote the neuron config (CPU mode: no NEFFs)"
    grammar = ("honoured (host sampling: vLLM's grammar on the returned logits)" if structured_outputs else
               "refused with HTTP 400 (on-device sampling; compile with --structured-outputs to honour them)")
    print(f"{what} for vllm-neuron in {time.perf_counter() - t0:.0f} s -> {path}\nstructured outputs (response_format, "
          f"tool_choice required/named): {grammar}\nserve it with:\n{serve_command(spec, override, path)}")
    return 0
