"""The off-device harness of the vLLM Neuron 1.x model contract (``scripts/test_vllm_neuron_offdevice.sh``).

* ``harness_platform/``: the pip-installable vLLM platform plugin ``m3_vneuron_harness`` (vLLM 0.24 on CPU, the
  contract's forward calls built as vllm-neuron's runner builds them);
* ``toy_model.py``: a tiny model written to the contract, with a dense no-cache oracle;
* ``drive.py``: one ``vllm.LLM`` run in a process of its own, requests arriving at chosen steps.
"""
