"""MiniMax-M3 on vLLM Neuron's model contract (the plugin line without NxDI, Neuron SDK >= 2.34).

* :mod:`.model`: :class:`~.model.MiniMaxM3ForCausalLM`, the factory the plugin builds (``from_configs``,
  ``get_kv_spec``, ``bind_kv_cache``, ``load_weights``, ``forward``): the reference model's layers (one rank's TP/EP
  slice, every checkpoint format through ``checkpoint/``) over paged caches;
* :mod:`.paged_cache`: the paged K/V and index-key caches a forward writes first and then reads through its block
  tables with ``ops.attention_step`` (block-sparse by page on sparse layers);
* :mod:`.contract`: the contract's types (the plugin's own where it is installed) and the serving checks;
* :mod:`.plugin`: registration in every vLLM process (``vllm.general_plugins``).

Neither vLLM Neuron nor NxDI is imported here; vLLM only for its tensor-parallel group, where it is initialised.
"""
