"""vLLM 0.24's scheduler with the grammar bitmask on its output, as the plugin's runner reads it.

vLLM 0.24's engine core asks for the grammar bitmask after ``execute_model`` (for ``sample_tokens``); the plugin's
runner reads it in ``execute_model`` from ``scheduler_output._grammar_bitmask`` (a compact packed int32 array, one row
per structured-output request) and ``scheduler_output._structured_output_request_ids`` (``_get_grammar_bitmask``,
``vllm_neuron/vllm/worker/neuron_model_runner.py`` at ed3580d), so that with on-device sampling the grammar is the
forward's ``logit_mask``. How the plugin puts them there was not read (its patches); here the scheduler attaches
them at ``schedule()``, from vLLM's own ``get_grammar_bitmask`` (a pure function of the requests' grammar states,
which advance only in ``update_from_output``).
"""

from __future__ import annotations

import numpy as np
from vllm.v1.core.sched.scheduler import Scheduler


class GrammarFirstScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        so = super().schedule(*args, **kwargs)
        grammar = self.get_grammar_bitmask(so)
        so._grammar_bitmask = None if grammar is None else np.array(grammar.grammar_bitmask, copy=True)
        so._structured_output_request_ids = None if grammar is None else list(grammar.structured_output_request_ids)
        return so
