"""Test support: the code the tests run that is not itself a test (nothing here is collected).

* ``neuron/``: the Neuron SDK stand-ins (``standins``: NxDI/NxD's Python sources importable in CPU mode), the
  ``--backend neuron-cpu`` pytest plugin (``cpu_plugin``, loaded by pyproject's ``addopts``) and the
  ``python -m``/``torchrun`` entry points that write and load pre-sharded rank files in fresh processes;
* ``hlo/``: the graph harness: ``torch_neuronx`` trace stand-ins (``standins_trace``, ``scribe``, ``nki_kernels``) and
  the ``python -m`` entry points that trace (``dry_run``, ``contrib_dry_run``, ``sampling_graph_dry_run``), execute
  (``execute_graphs``) and shard (``nxd_shard_tp64``) in fresh processes;
* ``vllm/``: the vLLM test platform plugin (``standin_platform``, a pip-installable project) and the
  compile-then-serve entry point of the smoke test;
* ``layer_functions``: a sparse layer's attention and the routed MoE as pure tensor functions (``test/xla``);
* ``distributed_rank``: one rank of the reference backend's gloo tests (``test/integration/test_distributed.py``).
"""
