"""The neuron config vllm-neuron 0.4.1 builds, fed to the port's NxDI config classes (as its loader does:
``get_neuron_config_cls()(**d)``, then ``get_config_cls()(nc, load_config=...)``).

``vllm_neuron_dict`` writes down what ``_get_default_neuron_config`` (``vllm_neuron/worker/
neuronx_distributed_model_loader.py``) returns, updated by ``override_neuron_config`` as its
``_get_neuron_config_after_override`` does; where vLLM and vllm-neuron are importable,
``test_the_dicts_are_vllm_neurons`` checks that against vllm-neuron's own function."""

import json

import pytest

from minimax_m3.config import M3Config

CPU = {"on_cpu": True, "attn_kernel_enabled": False, "qkv_kernel_enabled": False, "mlp_kernel_enabled": False}


def vllm_neuron_dict(tp=1, max_num_seqs=4, max_model_len=64, block_size=None, prefix_caching=False,
                     chunked_prefill=False, spec_tokens=None, override=None):
    """``_get_default_neuron_config`` for these vLLM settings (dtype float32), then the user's overrides."""
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig

    block_size = block_size or max_model_len  # the platform sets block_size = max_model_len without prefix caching
    batch = 1 if chunked_prefill else max_num_seqs
    d = {"tp_degree": tp, "ctx_batch_size": 1, "batch_size": batch,
         "max_context_length": max_model_len, "seq_len": max_model_len, "enable_bucketing": True,
         "is_continuous_batching": batch > 1, "quantized": False, "torch_dtype": "float32", "padding_side": "right",
         "on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True, deterministic=False),
         "lora_config": None, "pa_num_blocks": (max_model_len // block_size) * max_num_seqs,
         "pa_block_size": block_size, "is_block_kv_layout": chunked_prefill or prefix_caching,
         "is_prefix_caching": prefix_caching}
    if spec_tokens is not None:
        d.update(enable_fused_speculation=True, speculation_length=spec_tokens)
    d.update(override or {})
    return d


def _release_dir(tmp_path, preset="tiny"):
    (tmp_path / "config.json").write_text(json.dumps(M3Config.preset(preset).to_release_dict()))
    return str(tmp_path)


def build(d, model_dir):
    from minimax_m3.neuron.config import MiniMaxM3InferenceConfig, load_m3_config

    cls = MiniMaxM3InferenceConfig
    return cls(cls.get_neuron_config_cls()(**d), load_config=load_m3_config(model_dir))


TINY_BUCKETS = {"context_encoding_buckets": [16, 32, 64], "token_generation_buckets": [64]}


def test_default_dict_is_accepted_as_continuous_batching(nxdi, tmp_path):
    cfg = build(vllm_neuron_dict(override={**CPU, **TINY_BUCKETS}), _release_dir(tmp_path))
    nc = cfg.neuron_config
    assert nc.is_continuous_batching and nc.ctx_batch_size == 1 and nc.batch_size == 4
    assert nc.padding_side == "right" and nc.enable_bucketing
    assert nc.on_device_sampling_config.dynamic and not nc.on_device_sampling_config.deterministic
    assert (nc.moe_tp_degree, nc.moe_ep_degree) == (1, 1)


def test_one_sequence_is_static_batching(nxdi, tmp_path):
    nc = build(vllm_neuron_dict(max_num_seqs=1, override=TINY_BUCKETS), _release_dir(tmp_path)).neuron_config
    assert not nc.is_continuous_batching and nc.batch_size == 1


def test_trn2_serving_split_tp64_ep64_is_accepted(nxdi, tmp_path):
    """The README's command line: TP 64 (--tensor-parallel-size), experts over 64 ranks, one expert-TP rank."""
    d = vllm_neuron_dict(tp=64, max_num_seqs=8, max_model_len=8192, override={
        "moe_ep_degree": 64, "logical_nc_config": 2, "torch_dtype": "bfloat16",
        "context_encoding_buckets": [1024, 2048, 4096, 8192], "token_generation_buckets": [4096, 8192]})
    nc = build(d, _release_dir(tmp_path, "m3")).neuron_config
    assert (nc.tp_degree, nc.moe_tp_degree, nc.moe_ep_degree) == (64, 1, 64)


def test_a_prefill_chunk_in_the_override_serves_prompts_longer_than_its_buckets(nxdi, tmp_path):
    """``--max-model-len 64`` with ``prefill_chunk`` 32 (issue 23): the context buckets end at the chunk (given, or
    the spec's default buckets when none are), saved with the config; a chunk the layout cannot use is refused."""
    d = vllm_neuron_dict(override={**CPU, "context_encoding_buckets": [16, 32], "token_generation_buckets": [64],
                                   "prefill_chunk": 32})
    cfg = build(d, _release_dir(tmp_path))
    assert (cfg.prefill_chunk, cfg.neuron_config.max_context_length) == (32, 64)
    assert json.loads(cfg.to_json_string())["neuron_config"]["prefill_chunk"] == 32
    nc = build(vllm_neuron_dict(override={**CPU, "token_generation_buckets": [64], "prefill_chunk": 32}),
               _release_dir(tmp_path)).neuron_config
    assert nc.context_encoding_buckets == [32]
    assert build(vllm_neuron_dict(override={**CPU, **TINY_BUCKETS}), _release_dir(tmp_path)).prefill_chunk == 64
    with pytest.raises(ValueError, match=r"prefill chunk of 24 tokens.*\[16, 32\].*prefill_chunk in "
                                         "override_neuron_config"):
        build(vllm_neuron_dict(override={**CPU, "context_encoding_buckets": [24], "token_generation_buckets": [64],
                                         "prefill_chunk": 24}), _release_dir(tmp_path))


@pytest.mark.parametrize("settings, flag", [
    ({"prefix_caching": True}, "--no-enable-prefix-caching"),
    ({"chunked_prefill": True, "override": {"chunked_prefill_config": {"max_num_seqs": 4}}},
     "--enable-chunked-prefill"),
    ({"spec_tokens": 4}, "--speculative-config"),
    ({"override": {"token_generation_buckets": [32], "context_encoding_buckets": [16, 32, 64]}}, "--max-model-len"),
    ({"override": {"context_encoding_buckets": [16, 32], "token_generation_buckets": [64]}}, "--max-model-len"),
    ({"tp": 2, "override": {"moe_ep_degree": 3, **TINY_BUCKETS}}, "--tensor-parallel-size"),
])
def test_what_the_port_cannot_serve_is_one_error_naming_the_vllm_flag(nxdi, tmp_path, settings, flag):
    with pytest.raises(ValueError) as e:
        build(vllm_neuron_dict(**settings), _release_dir(tmp_path))
    assert flag in str(e.value) and "MiniMax-M3" in str(e.value)


def test_the_dicts_are_vllm_neurons(nxdi):
    """The hand-written dicts above equal what vllm-neuron's own function builds (where vLLM is installed)."""
    pytest.importorskip("vllm")
    import os
    import sys

    src = os.environ.get("VLLM_NEURON_SRC", "")
    if not os.path.isdir(os.path.join(src, "vllm_neuron")):
        pytest.skip("set VLLM_NEURON_SRC to a vllm-neuron 0.4.1 checkout")
    sys.path.insert(0, src)
    from types import SimpleNamespace as NS

    from vllm_neuron.worker.neuronx_distributed_model_loader import _get_default_neuron_config

    import torch

    for kw in ({}, {"max_num_seqs": 1}, {"prefix_caching": True, "block_size": 32}, {"spec_tokens": 3}):
        block = kw.get("block_size", 64)
        got = _get_default_neuron_config(
            NS(max_model_len=64, dtype=torch.float32),
            NS(block_size=block, num_gpu_blocks_override=None, enable_prefix_caching=kw.get("prefix_caching", False)),
            NS(tensor_parallel_size=1),
            NS(enable_chunked_prefill=False, max_num_seqs=kw.get("max_num_seqs", 4), max_num_batched_tokens=64),
            None, NS(num_speculative_tokens=kw["spec_tokens"], method=None) if "spec_tokens" in kw else None)
        want = vllm_neuron_dict(**kw)
        got_osc, want_osc = got.pop("on_device_sampling_config"), want.pop("on_device_sampling_config")
        assert vars(got_osc) == vars(want_osc)
        got["torch_dtype"] = str(got["torch_dtype"]).replace("torch.", "")
        assert got == want


@pytest.mark.parametrize("form", ["release", "transformers"])
def test_both_config_forms_load_as_vllm_and_vllm_neuron_read_them(nxdi, tmp_path, form):
    """transformers < 5 (vLLM's pin) does not know ``minimax_m3_vl``: the plugin's config class parses either form
    (the transformers form as transformers 5.23 writes it: ``data/``) and NxDI's ``load_pretrained_config``, which
    vllm-neuron calls, gives the port the same model description."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "minimax_m3_vl" in CONFIG_MAPPING and "minimax_m3_vl" not in CONFIG_MAPPING._extra_content:
        pytest.skip("this transformers has minimax_m3_vl itself (vLLM 0.13 pins transformers < 5)")
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    from minimax_m3.neuron.vllm import plugin as vllm_plugin
    from minimax_m3.neuron.config import MiniMaxM3InferenceConfig

    from pathlib import Path

    tiny = M3Config.preset("tiny")
    raw = tiny.to_release_dict() if form == "release" else \
        json.loads((Path(__file__).parent / "data" / "tiny_config_transformers_form.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    vllm_plugin.register_config()
    hf = AutoConfig.from_pretrained(tmp_path)
    assert hf.get_text_config() is hf and hf.architectures == ["MiniMaxM3SparseForConditionalGeneration"]
    # what vllm-neuron's _get_model_configs and vLLM's ModelConfig read at the top level
    assert (hf.num_key_value_heads, hf.head_dim, hf.num_attention_heads, hf.hidden_size) == (2, 32, 8, 128)
    assert (hf.num_hidden_layers, hf.vocab_size, hf.max_position_embeddings) == (4, 512, 4096)
    d = vllm_neuron_dict(override={**CPU, **TINY_BUCKETS})
    cfg = MiniMaxM3InferenceConfig(MiniMaxM3InferenceConfig.get_neuron_config_cls()(**d),
                                   load_config=load_pretrained_config(str(tmp_path)))
    assert cfg.m3_config() == tiny
    assert (cfg.num_key_value_heads, cfg.num_local_experts) == (2, 8)
