"""Every private name of NxD / NxDI (and of torch, transformers and vllm-neuron) that code under
``src/minimax_m3/neuron/`` uses, with where upstream defines it, why the port uses it and which files use it.

Data only: no code runs here, and nothing is imported (``test/unit/test_port_hooks.py`` reads :data:`PRIVATES` from
this file's source with ``ast.literal_eval``, without the SDK). A private name starts with an underscore and is not a
dunder; it is used when read, called or assigned as an attribute, defined as a method or class attribute in a class,
imported from an upstream module, or given as a string literal to ``getattr``/``setattr``/``hasattr``/``delattr``.

Each entry: ``kind`` is ``"hook"`` (a method or attribute the port's subclasses override or set, as NxDI's in-tree
``qwen3_moe`` and ``gpt_oss`` do, and may call; the only kind the model files may use) or ``"internal"`` (upstream
code the port reads, calls or sets without overriding it); ``upstream`` names the version (Neuron SDK 2.29: NxDI 0.9
at 4bcdc54, NxD 0.18 "Release 2.29", on torch 2.9 and transformers 4.57; vllm-neuron 0.4.1) and the file that
defines or reads the name; ``why`` says what the port uses it for; ``used_in`` lists the files (relative to
``neuron/``) that use it. ``test_port_hooks`` checks the table both ways: every upstream private name used in a file
of ``neuron/`` is here with that file listed, and every listed file uses the name.
"""

PRIVATES = {
    # ---- hooks: the port's subclasses override or set them --------------------------------------------------------
    "_model_cls": {
        "kind": "hook",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseForCausalLM._model_cls",
        "why": "the application's traced-model class (qwen3_moe and gpt_oss set it too); a fused build sets "
               "eagle.M3FusedSpecModel where NxDI's __init__ set its NeuronFusedSpecModel",
        "used_in": ("model.py", "eagle.py"),
    },
    "_init_kv_shape": {
        "kind": "hook",
        "upstream": "NxDI 0.9 modules/kvcache/kv_cache_manager.py: KVCacheManager._init_kv_shape",
        "why": "the cache manager's shape hook, called from its constructor: the sharded layout's line length "
               "(max_len / G)",
        "used_in": ("kv_cache.py",),
    },
    "_is_prefill": {
        "kind": "hook",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseForCausalLM._is_prefill",
        "why": "NxDI's routing of a call to context encoding or token generation, overridden so a chunk of a chunked "
               "prefill at p0 > 0 runs the context-encoding graph; the chunk loop asks it whether a call is a "
               "prefill",
        "used_in": ("model.py", "chunk_loop.py"),
    },
    "_eagle_context_encoding_forward": {
        "kind": "hook",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronFusedSpecModel._eagle_context_encoding_forward",
        "why": "NxDI's fused EAGLE prefill, overridden so the draft follows a prompt prefilled in several calls",
        "used_in": ("eagle.py",),
    },
    "_cte_postprocessor": {
        "kind": "hook",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronFusedSpecModel._cte_postprocessor",
        "why": "NxDI's fused prefill outputs: a call's next position counted from its first position when a prompt "
               "takes several calls",
        "used_in": ("eagle.py",),
    },
    "_apply": {
        "kind": "hook",
        "upstream": "torch 2.9 (Neuron SDK 2.29's) nn/modules/module.py: Module._apply",
        "why": "the cast entry NxDI's cast policy and to_cpu's .bfloat16() go through (layers.KeepFP32 and "
               "moe.M3Router keep their fp32 parameters there)",
        "used_in": ("layers.py", "moe.py"),
    },
    "_sample_on_device": {
        "kind": "hook",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseModel._sample_on_device",
        "why": "the only place NxDI's forward samples; nxd_compat.OnDeviceSamplingHook routes it to the model's "
               "public sample_on_device",
        "used_in": ("nxd_compat/forward.py",),
    },
    "_copy_past_key_values": {
        "kind": "hook",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseForCausalLM._copy_past_key_values",
        "why": "CPU mode's copy of a call's caches back into the submodels, overridden by "
               "nxd_compat.SpeculationOutputs for a speculation build and the draft's target states",
        "used_in": ("nxd_compat/forward.py",),
    },
    "_get_constructed_outputs": {
        "kind": "hook",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseForCausalLM._get_constructed_outputs",
        "why": "the application's outputs of a call, overridden by nxd_compat.SpeculationOutputs (aux_states, "
               "fused speculation's outputs in CPU mode)",
        "used_in": ("nxd_compat/forward.py",),
    },
    # ---- internals: read, called or set, not overridden -------------------------------------------------------------
    "_construct_output": {
        "kind": "internal",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseForCausalLM._construct_output",
        "why": "builds the output object of fused speculation's four outputs in CPU mode, as NxDI does on device",
        "used_in": ("nxd_compat/forward.py",),
    },
    "_infer_attention_mask": {
        "kind": "internal",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseForCausalLM._infer_attention_mask",
        "why": "the mask NxDI's forward infers for a call without one (vllm-neuron's prefills), inferred before the "
               "chunk loop slices it (nxd_compat.infer_attention_mask)",
        "used_in": ("nxd_compat/forward.py",),
    },
    "_is_context_encoding": {
        "kind": "internal",
        "upstream": "NxDI 0.9 models/model_base.py: NeuronBaseModel._is_context_encoding",
        "why": "whether the traced model treats a call as context encoding (nxd_compat.is_context_encoding)",
        "used_in": ("nxd_compat/forward.py",),
    },
    "_top_k_masked": {
        "kind": "internal",
        "upstream": "NxDI 0.9 modules/generation/sampling.py: Sampler._top_k_masked",
        "why": "NxDI's distributed top-k candidate search on device, without a per-row mask "
               "(nxd_compat.sampler_global_top_k)",
        "used_in": ("nxd_compat/forward.py",),
    },
    "_gather_along_dim": {
        "kind": "internal",
        "upstream": "NxD 0.18 parallel_layers/mappings.py: _gather_along_dim",
        "why": "NxD's all-gather over a given process group: the KV group's (nxd_compat.KVGroupOps) and, in CPU "
               "mode, an EAGLE draft's vocabulary shards (nxd_compat.cpu_argmax)",
        "used_in": ("nxd_compat/forward.py", "nxd_compat/cpu_mode.py"),
    },
    "_FUSED_PREFIX": {
        "kind": "internal",
        "upstream": "NxDI 0.9 models/application_base.py: NeuronApplicationBase._FUSED_PREFIX",
        "why": "the key prefix NxDI's fused loader sets on the draft class; the port's fused state dict sets and "
               "reads it the same way (nxd_compat.fused_state_dict, with_fused_prefix)",
        "used_in": ("nxd_compat/weights.py",),
    },
    "_name_or_path": {
        "kind": "internal",
        "upstream": "transformers 4.57 (NxDI's pin) configuration_utils.py: PretrainedConfig._name_or_path, read by "
                    "NxDI 0.9 models/application_base.py: NeuronApplicationBase.checkpoint_loader_fn",
        "why": "the checkpoint directory NxDI's loader reads: set by config.config_hook (NxDI's "
               "load_pretrained_config cannot parse config.json), read by nxd_compat.checkpoint_path",
        "used_in": ("config.py", "nxd_compat/weights.py"),
    },
    "_get_default_neuron_config": {
        "kind": "internal",
        "upstream": "vllm-neuron 0.4.1 worker/neuronx_distributed_model_loader.py: _get_default_neuron_config",
        "why": "the neuron config vllm-neuron builds from vLLM's settings (vllm.defaults.vllm_neuron_config)",
        "used_in": ("vllm/defaults.py",),
    },
    "_get_neuron_config_after_override": {
        "kind": "internal",
        "upstream": "vllm-neuron 0.4.1 worker/neuronx_distributed_model_loader.py: "
                    "_get_neuron_config_after_override",
        "why": "vllm-neuron's merge of override_neuron_config into its defaults (vllm.defaults.vllm_neuron_config)",
        "used_in": ("vllm/defaults.py",),
    },
    "_MOE_TKG_TENSOR_MODEL_PARALLEL_GROUP": {
        "kind": "internal",
        "upstream": "NxD 0.18 modules/moe/moe_process_group.py: _MOE_TKG_TENSOR_MODEL_PARALLEL_GROUP",
        "why": "CPU mode with --decode-experts tp: NxD makes its hybrid MoE groups with XLA meshes (new_group of "
               "the first mesh group only), which gloo ranks outside that group cannot use; cpu_mode sets each "
               "rank's own gloo group before NxD looks (it builds them only when unset)",
        "used_in": ("nxd_compat/cpu_mode.py",),
    },
    "_MOE_TKG_EXPERT_MODEL_PARALLEL_GROUP": {
        "kind": "internal",
        "upstream": "NxD 0.18 modules/moe/moe_process_group.py: _MOE_TKG_EXPERT_MODEL_PARALLEL_GROUP",
        "why": "CPU mode with --decode-experts tp: NxD makes its hybrid MoE groups with XLA meshes (new_group of "
               "the first mesh group only), which gloo ranks outside that group cannot use; cpu_mode sets each "
               "rank's own gloo group before NxD looks (it builds them only when unset)",
        "used_in": ("nxd_compat/cpu_mode.py",),
    },
    "_MOE_CTE_TENSOR_MODEL_PARALLEL_GROUP": {
        "kind": "internal",
        "upstream": "NxD 0.18 modules/moe/moe_process_group.py: _MOE_CTE_TENSOR_MODEL_PARALLEL_GROUP",
        "why": "CPU mode with --decode-experts tp: NxD makes its hybrid MoE groups with XLA meshes (new_group of "
               "the first mesh group only), which gloo ranks outside that group cannot use; cpu_mode sets each "
               "rank's own gloo group before NxD looks (it builds them only when unset)",
        "used_in": ("nxd_compat/cpu_mode.py",),
    },
    "_MOE_CTE_EXPERT_MODEL_PARALLEL_GROUP": {
        "kind": "internal",
        "upstream": "NxD 0.18 modules/moe/moe_process_group.py: _MOE_CTE_EXPERT_MODEL_PARALLEL_GROUP",
        "why": "CPU mode with --decode-experts tp: NxD makes its hybrid MoE groups with XLA meshes (new_group of "
               "the first mesh group only), which gloo ranks outside that group cannot use; cpu_mode sets each "
               "rank's own gloo group before NxD looks (it builds them only when unset)",
        "used_in": ("nxd_compat/cpu_mode.py",),
    },
}
