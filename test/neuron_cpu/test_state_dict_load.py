"""Loading the converted state dict into the NxDI model in NxDI's CPU mode (this process's TP degree, 1 in-process).

NxDI loads with ``strict=False``, so a target the converter misnames would leave that parameter at its random
initialisation without a word. Here a test-only subclass of the port's application drops one tensor and misnames
another: loading must fail with one error naming both parameters. The unmodified port loads with NxD removing no
redundant key (the attention output's key used to be copied one level deeper by NxD's preshard hook and removed),
and an fp32 key cast by mistake is one error too.

In-process only (not under torchrun: there NxDI's ``to_cpu()`` joins the process group once per process).
"""

import ast
import warnings

import pytest
import torch

from minimax_m3.config import M3Config

pytestmark = pytest.mark.neuron_cpu
DROPPED = "layers.1.self_attn.index_k_norm.weight"
MISNAMED = "layers.2.moe.router.e_score_correction_bias"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("load") / "tiny", M3Config.preset("tiny"), seed=0)


def _app(ckpt, cls=None):
    from minimax_m3.neuron.build import inference_config
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM

    from test.support.neuron.cpu_plugin import nxdi_spec

    spec, m3 = nxdi_spec(ckpt, max_batch=1, max_seq_len=32, max_context_len=24)
    config = inference_config(spec, m3)
    return (cls or NeuronMiniMaxM3ForCausalLM)(str(ckpt), config)


def _edited(edit):
    """A test-only application whose converted state dict passes through ``edit`` before NxD sees it."""
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM

    class Edited(NeuronMiniMaxM3ForCausalLM):
        @classmethod
        def get_state_dict(cls, model_name_or_path, config):
            return edit(super().get_state_dict(model_name_or_path, config))

    return Edited


@pytest.fixture(scope="module")
def single_process(neuron_cpu_tp):
    if neuron_cpu_tp != 1:
        pytest.skip("builds several NxDI models: in-process (TP 1) only")


def test_port_loads_with_no_redundant_key(ckpt, single_process):
    from minimax_m3.neuron.nxd_compat import to_cpu as _to_cpu

    app = _app(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _to_cpu(app)
    removed = [ast.literal_eval(str(w.message).split(": ", 1)[1]) for w in caught
               if str(w.message).startswith("Removing redundant keys from checkpoint: ")]
    assert removed, "NxD's preprocess_checkpoint did not run (its warning is unconditional)"
    assert all(r == [] for r in removed), removed


def test_missing_and_misnamed_parameters_fail_the_load_by_name(ckpt, single_process):
    from minimax_m3.checkpoint import CheckpointError
    from minimax_m3.neuron.nxd_compat import to_cpu as _to_cpu

    def edit(sd):
        del sd[DROPPED]
        sd[MISNAMED.replace("correction_bias", "correction.bias")] = sd.pop(MISNAMED)
        return sd

    app = _app(ckpt, _edited(edit))
    with pytest.raises(CheckpointError) as err:
        _to_cpu(app)
    named = [p.split(":")[0] for p in err.value.problems]
    assert sorted(named) == sorted([DROPPED, MISNAMED])
    assert "nxdi_rules" in str(err.value)


def test_an_fp32_key_cast_by_mistake_is_one_error(ckpt, single_process):
    from minimax_m3.checkpoint import CheckpointError

    keys = ("norm.weight", "layers.3.moe.router.linear_router.weight")

    def edit(sd):
        for k in keys:
            sd[k] = sd[k].to(torch.bfloat16)
        return sd

    with pytest.raises(CheckpointError) as err:
        _app(ckpt, _edited(edit)).checkpoint_loader_fn()
    assert sorted(p.split(":")[0] for p in err.value.problems) == sorted(keys)
