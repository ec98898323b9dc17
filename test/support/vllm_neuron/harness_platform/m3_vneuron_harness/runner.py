"""The model runner of the off-device harness: vLLM 0.24's scheduler output in, the vLLM Neuron 1.x model contract's
forward calls out (built by :mod:`.inputs` as vllm-neuron's runner builds them), host sampling by vLLM's own sampler
(or, with ``on_device_sampling_config``, the model's ids), and with ``--speculative-config`` the EAGLE3 draft
(:mod:`.speculative`): after every forward the draft proposes (the plugin's ``EagleProposer.propose``) and the
drafts go to vLLM's scheduler through ``take_draft_token_ids``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib

import numpy as np
import torch

from . import contract
from .inputs import Forward, ForwardInputs

log = logging.getLogger(__name__)


class HarnessRunner(ForwardInputs):
    def __init__(self, vllm_config, device: torch.device):
        self.vllm_config = vllm_config
        self.device = device
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.max_model_len = self.model_config.max_model_len
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.neuron_config = contract.resolve_neuron_config(vllm_config)
        self.max_num_batched_tokens = max(vllm_config.scheduler_config.max_num_batched_tokens,
                                          self.neuron_config.harness_notes["max_num_batched_tokens"])
        self.spec = vllm_config.speculative_config
        self.k = int(self.spec.num_speculative_tokens) if self.spec is not None else 0  # drafts per verify step
        self.proposer = None  # the EAGLE3 draft (.speculative), built by load_model
        self._drafts = None  # DraftTokenIds for the scheduler, after each step
        hf = self.model_config.hf_config
        self.vocab_size = getattr(getattr(hf, "text_config", hf), "vocab_size", None) or hf.vocab_size
        self.model = None
        self.compiled = None
        self.kv_cache_config = None
        self.input_batch = None
        self.requests: dict = {}
        self.step = 0
        self.forward_count = 0
        self.token_counts: dict[str, int] = {}  # tokens each request ran through the model
        self._pending = None  # (scheduler_output, logits) between execute_model and sample_tokens
        self.trace_path = os.environ.get("M3_VNEURON_TRACE") or None
        from vllm.v1.sample.sampler import Sampler

        self.sampler = Sampler(logprobs_mode=getattr(self.model_config, "logprobs_mode", "raw_logprobs"))
        try:
            from vllm.distributed.parallel_state import get_tp_group

            tp_rank = get_tp_group().rank_in_group
        except Exception:  # parallel state not initialised (unit use)
            tp_rank = 0
        self.rank_tensor = torch.tensor(tp_rank, dtype=torch.int32, device=device)  # R@32000

    # ---------------------------------------------------------------- model
    def load_model(self) -> None:
        """R@48000 ``load_model``: the factory from the registry, built on the meta device, ``load_weights(path,
        device, download_dir)`` materialises it, ``.to(device)``."""
        registry = contract.model_registry()
        archs = list(getattr(self.model_config.hf_config, "architectures", None) or [])
        arch = next((a for a in archs if a in registry), None)
        if arch is None:
            raise ValueError(f"no contract model for architectures {archs} (registry: {sorted(registry)}); "
                             "set M3_VNEURON_MODELS=module:DICT")
        factory = registry[arch]
        with torch.device("meta"):
            model = factory.from_configs(self.model_config.hf_config, self.neuron_config)
        model.load_weights(self.model_config.model, self.device, self.vllm_config.load_config.download_dir)
        self.model = model.to(self.device)
        if self.spec is not None:  # R@48000: the draft, and the target's taps (the draft's ids, else the model's)
            from .speculative import Proposer

            self.proposer = Proposer(self.vllm_config, self.device, registry)
            model.set_aux_hidden_state_layers(self.proposer.aux_layers or model.get_eagle3_aux_hidden_state_layers())
            self._trace({"event": "draft", "class": type(self.proposer.model).__name__,
                         "sharded": getattr(self.proposer.model, "sharded", None),
                         "kv_spec": [[s.name, s.num_kv_heads, s.head_size]
                                     for s in self.proposer.model.get_kv_spec().layers]})
        backend = os.environ.get("M3_VNEURON_COMPILE", "")
        if backend:  # R@64000: torch.compile(fullgraph) — recompiles after warm-up are errors
            torch._dynamo.config.cache_size_limit = 1 << 20
            self.compiled = torch.compile(self.model, backend=backend, fullgraph=True, dynamic=False)
        log.info("harness: %s built as %s (compile=%s)", arch, type(self.model).__name__, backend or "off")

    def _callable(self):
        return self.compiled if self.compiled is not None else self.model

    # ------------------------------------------------------------- KV cache
    def kv_cache_dtype(self) -> torch.dtype:
        from vllm.utils.torch_utils import get_kv_cache_torch_dtype

        return get_kv_cache_torch_dtype(self.cache_config.cache_dtype, self.model_config.dtype)

    def get_kv_cache_spec(self) -> dict:
        """R@384000 ``get_kv_cache_spec``: one vLLM spec per LayerSpec, block size from the cache config, dtype the
        cache dtype for *every* layer (LayerSpec.dtype is not read); FullAttentionSpec, or SlidingWindowSpec when
        ``sliding_window_size`` is set."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        block_size, dtype = self.cache_config.block_size, self.kv_cache_dtype()
        specs = {}
        layers = list(self.model.get_kv_spec().layers)
        if self.proposer is not None:  # the draft's layers beside the target's (one group: E@)
            layers += list(self.proposer.model.get_kv_spec().layers)
        for layer in layers:
            if layer.sliding_window_size is None:
                specs[layer.name] = FullAttentionSpec(
                    block_size=block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size, dtype=dtype,
                    sliding_window=layer.sliding_window_size, attention_chunk_size=layer.chunk_size)
            else:
                specs[layer.name] = SlidingWindowSpec(
                    block_size=block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size, dtype=dtype,
                    sliding_window=layer.sliding_window_size)
        return specs

    def initialize_kv_cache(self, kv_cache_config) -> dict:
        """R@384000 ``initialize_kv_cache``: vLLM's InputBatch with one block size per group; each KVCacheTensor a
        zeroed byte buffer viewed as [2, num_blocks, num_kv_heads, block_size, head_size] of the spec's dtype, K and V
        its two halves; ``model.bind_kv_cache({name: [k, v]})``."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs
        from vllm.v1.sample.logits_processor import build_logitsprocs
        from vllm.v1.worker.gpu_input_batch import InputBatch

        self.kv_cache_config = kv_cache_config
        block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, device=self.device, vocab_size=self.vocab_size,
            block_sizes=block_sizes, kernel_block_sizes=block_sizes,
            # the plugin passes logitsprocs=None (R@384000): no min_tokens / logit_bias processors there
            logitsprocs=build_logitsprocs(self.vllm_config, self.device, False, False,
                                          self.model_config.logits_processors or ()),
            is_pooling_model=False)
        raw = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            if getattr(tensor, "offset", 0) or getattr(tensor, "block_stride", None):
                raise NotImplementedError("packed KV cache layouts (vLLM's DeepSeek-V4 path) are not served")
            buf = torch.zeros(tensor.size, dtype=torch.int8, device=self.device)
            for name in tensor.shared_by:
                raw[name] = buf
        caches = {}
        self.layer_group = {}
        for gi, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):  # one group, per-layer sizes (R@384000)
                    spec = spec.kv_cache_specs[name]
                if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
                    raise NotImplementedError(f"unsupported KV spec {type(spec).__name__} for {name}")
                buf = raw[name]
                num_blocks = buf.numel() // spec.page_size_bytes
                shape = (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)
                typed = buf.view(spec.dtype)[: int(np.prod(shape))].view(shape)
                caches[name] = [typed[0], typed[1]]
                self.layer_group[name] = gi
        self.model.bind_kv_cache(caches)
        if self.proposer is not None:
            self.proposer.check_group(self.layer_group)
            self.proposer.model.bind_kv_cache(caches)
        self.kv_caches = caches
        self._trace({"event": "kv_cache", "num_blocks": kv_cache_config.num_blocks, "groups": [
            {"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
             "layers": {n: list(caches[n][0].shape) for n in g.layer_names},
             "block_table_width": int(self.input_batch.block_table[gi].block_table.cpu.shape[1])}
            for gi, g in enumerate(kv_cache_config.kv_cache_groups)]})
        return caches

    # ---------------------------------------------------------- requests
    def _update_states(self, so) -> None:
        """Requests tracked from the scheduler output (vLLM's InputBatch holds the scheduled ones, in batch order)."""
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        ib = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            ib.remove_request(rid)
        cached = so.scheduled_cached_reqs
        keep = set(so.num_scheduled_tokens) - set(cached.resumed_req_ids)
        for rid in list(ib.req_id_to_index):
            if rid not in keep:  # unscheduled (preempted or waiting a step): out of the batch, state kept
                ib.remove_request(rid)
        to_add = []
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = None
            if sp is not None and sp.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
            st = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids, mm_features=new.mm_features,
                sampling_params=sp, generator=gen, block_ids=tuple(list(b) for b in new.block_ids),
                num_computed_tokens=new.num_computed_tokens, output_token_ids=[], lora_request=new.lora_request,
                prompt_embeds=new.prompt_embeds, pooling_params=new.pooling_params)
            self.requests[new.req_id] = st
            to_add.append(st)
        for i, rid in enumerate(cached.req_ids):
            st = self.requests[rid]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.num_output_tokens[i] < len(st.output_token_ids):
                del st.output_token_ids[cached.num_output_tokens[i]:]
            new_blocks = cached.new_block_ids[i]
            resumed = rid in cached.resumed_req_ids
            if resumed:
                st.block_ids = tuple(list(b) for b in new_blocks)
            elif new_blocks is not None:
                for ids, more in zip(st.block_ids, new_blocks):
                    ids.extend(more)
            idx = ib.req_id_to_index.get(rid)
            if idx is None:
                to_add.append(st)
                continue
            ib.num_computed_tokens_cpu[idx] = st.num_computed_tokens
            if new_blocks is not None and not resumed:
                ib.block_table.append_row(new_blocks, idx)
        for st in to_add:
            ib.add_request(st)
        ib.condense()
        ib.refresh_metadata()

    # ----------------------------------------------------------- execute
    def execute_model(self, so):
        self.step += 1
        self._scheduled = so  # the step's scheduler output (its grammar bitmask: inputs._logit_mask)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            self._trace({"step": self.step, "event": "empty"})
            return EMPTY_MODEL_RUNNER_OUTPUT
        logits = torch.empty(self.input_batch.num_reqs, self.vocab_size, dtype=torch.float32)
        ods = self.neuron_config.on_device_sampling_config is not None
        drawn = torch.full((self.input_batch.num_reqs,), -1, dtype=torch.int64)
        verified, ran = {}, []  # a verify row's logits at each token (or its tokens); (forward, rows, target states)
        for fwd, rows in self._plan(so):
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self._callable()(**fwd.kwargs)
            ids, out, states = self._outputs(out, fwd, ods)
            if out.shape[0] != fwd.kwargs["sampling_positions"].shape[0]:
                raise RuntimeError(f"model returned {tuple(out.shape)} logits for "
                                   f"{fwd.kwargs['sampling_positions'].shape[0]} sampling positions")
            if fwd.kind == "verify":
                k1 = 1 + self.k
                for i, (rid, n) in enumerate(zip(fwd.req_ids, fwd.num_tokens)):
                    if ids is not None:  # decided on the device: the accepted drafts and the bonus, -1 after
                        verified[rid] = [t for t in ids[i].tolist() if t >= 0]
                    else:  # the host's rejection step decides from the logits at each token
                        verified[rid] = out[i * k1:i * k1 + n].to(torch.float32).cpu()
                out = out[::k1]  # each row's first token: what the host sampler sees for it
            elif ids is not None:
                drawn[rows] = ids[: len(rows)].to(torch.int64).cpu()
            logits[rows] = out[: len(rows)].to(torch.float32).cpu()
            ran.append((fwd, rows, states))
            self.forward_count += 1
            for rid, n in zip(fwd.req_ids, fwd.num_tokens):
                self.token_counts[rid] = self.token_counts.get(rid, 0) + n
            m0 = next(iter(fwd.kwargs["attn_metadata"].values()))
            self._trace({
                "step": self.step, "event": "forward", "forward": self.forward_count, "kind": fwd.kind,
                "req_ids": fwd.req_ids, "num_tokens": fwd.num_tokens, "first_positions": fwd.first_positions,
                "input_ids_shape": list(fwd.kwargs["input_ids"].shape), "dcp_slots": int(m0["slot_mapping"].numel()),
                "block_table_shape": list(m0["block_table_tensor"].shape),
                "max_query_len": m0["max_query_len"], "cached_seq_len": int(m0["cached_seq_len"].item()),
                "kv_segment_size": m0["kv_segment_size"], "seconds": round(time.perf_counter() - t0, 4)})
        self._pending = (so, logits, drawn if ods else None, verified, ran)
        return None

    def _outputs(self, out, fwd: Forward, ods: bool):
        """R@320000, what the model returned: ``(sampled ids or None, logits, EAGLE3 target states or None)``.
        Host sampling: logits, or ``(logits, states)`` with a draft. On-device sampling: ``(ids, logits)``, with a
        draft ``(ids, states, logits)``, and in a verify step ``(tokens [rows, 1 + k], states, logits, last)``."""
        draft = self.proposer is not None
        if not ods:
            if not draft:
                if isinstance(out, tuple):
                    raise RuntimeError("host sampling wants logits [rows, vocab], not a tuple")
                return None, out, None
            if not (isinstance(out, tuple) and len(out) == 2):
                raise RuntimeError("with a draft the model must return (logits, target states) (R@320000)")
            return None, out[0], out[1]
        want = 2 if not draft else (4 if fwd.kind == "verify" else 3)
        if not (isinstance(out, tuple) and len(out) == want and out[0].dtype == torch.int32):
            raise RuntimeError(f"on-device sampling: the model must return {want} outputs, sampled int32 ids first "
                               "(R@320000)")
        return (out[0], out[1], None) if want == 2 else (out[0], out[2], out[1])

    def sample_tokens(self, grammar_output):
        """vLLM's sampler over the logits in batch order (the plugin's CPU-sampling path, R@352000 ``_sample``); the
        grammar bitmask applied first by vLLM's ``apply_grammar_bitmask``; a request whose prompt is not yet all
        computed gets no token (R@352000 ``_get_partial_prefill_req_ids``)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        if self._pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        so, logits, drawn, verified, ran = self._pending
        self._pending = None
        ib = self.input_batch
        if verified and (ib.sampling_metadata.max_num_logprobs or grammar_output is not None):
            raise NotImplementedError("the harness runs no logprobs or structured outputs with drafts")
        if grammar_output is not None and grammar_output.grammar_bitmask is not None:
            from vllm.v1.structured_output.utils import apply_grammar_bitmask

            apply_grammar_bitmask(so, grammar_output, ib, logits)
        out = None
        if drawn is None or ib.sampling_metadata.max_num_logprobs:  # on device: the host sampler for logprobs only
            out = self.sampler(logits=logits, sampling_metadata=ib.sampling_metadata)
        sampled = (drawn if drawn is not None else out.sampled_token_ids.view(-1)).tolist()
        req_ids = list(ib.req_ids)
        tokens: list[list[int]] = []
        for i, rid in enumerate(req_ids):
            st = self.requests[rid]
            if ib.num_computed_tokens_cpu[i] + so.num_scheduled_tokens[rid] < st.num_tokens:
                tokens.append([])  # a chunk of a prompt: its sample is discarded
                continue
            if rid in verified and isinstance(verified[rid], list):  # decided on the device
                new = verified[rid]
            elif rid in verified:  # the drafts the target accepts, then its token after them
                from .speculative import accept

                sp, first = st.sampling_params, int(ib.num_computed_tokens_cpu[i]) + 1
                seed = sp.seed if sp.seed is not None else zlib.crc32(rid.encode())
                new = accept(verified[rid], list(so.scheduled_spec_decode_tokens[rid]), sp, seed, first)
            else:
                new = [int(sampled[i])]
            tokens.append(new)
            for tok in new:
                end = int(ib.num_tokens_no_spec[i])
                ib.token_ids_cpu[i, end] = tok
                ib.is_token_ids[i, end] = True
                ib.num_tokens_no_spec[i] = end + 1
                st.output_token_ids.append(tok)
        self._trace({"step": self.step, "event": "sampled",
                     "tokens": {rid: t for rid, t in zip(req_ids, tokens)}})
        if self.proposer is not None:
            self._propose(ran, tokens, req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index=dict(ib.req_id_to_index), sampled_token_ids=tokens,
            logprobs=out.logprobs_tensors.tolists() if out is not None and out.logprobs_tensors is not None else None,
            prompt_logprobs_dict={}, pooler_output=[])

    # ------------------------------------------------------------ drafts
    def _propose(self, ran: list, tokens: list[list[int]], req_ids: list[str]) -> None:
        """E@ ``propose`` after each target forward: the draft writes its entries for the forward's tokens (a prompt
        chunk's too, whose last entry reads the prompt's next token) and drafts for every request that got tokens
        (``take_draft_token_ids`` hands them to the scheduler)."""
        ib, k1 = self.input_batch, 1 + self.k
        out: dict[str, list[int]] = {}
        for fwd, rows, states in ran:
            padded = fwd.kwargs["sampling_positions"].shape[0]
            if fwd.kind == "prefill":  # the token after the segment: the sampled one, or the prompt's next
                raw = [[int(ib.token_ids_cpu[rows[0], fwd.first_positions[0] + fwd.num_tokens[0]])]]
                last = [fwd.num_tokens[0] - 1]
            elif fwd.kind == "decode":
                raw = [[int(ib.token_ids_cpu[r, p + 1])] for r, p in zip(rows, fwd.first_positions)]
                raw += [[0]] * (padded - len(rows))
                last = list(range(padded))
            else:  # verify: the row's tokens (accepted drafts, bonus), -1 after them
                padded //= k1
                raw = [tokens[r] + [-1] * (k1 - len(tokens[r])) for r in rows]
                raw += [[0] + [-1] * self.k] * (padded - len(rows))
                last = [i * k1 + self.k for i in range(padded)]
            _, drafts = self.proposer.propose(fwd.kwargs, states, torch.tensor(last, device=self.device),
                                              torch.tensor(raw, dtype=torch.int32, device=self.device))
            for j, r in enumerate(rows):
                if tokens[r]:
                    out[req_ids[r]] = drafts[j].tolist()
        self._drafts = out or None
        self._trace({"step": self.step, "event": "drafts", "drafts": out})

    def take_draft_token_ids(self):
        """The last step's drafts for vLLM's scheduler (``DraftTokenIds``), once."""
        from vllm.v1.outputs import DraftTokenIds

        drafts, self._drafts = self._drafts, None
        if not drafts:
            return None
        return DraftTokenIds(req_ids=list(drafts), draft_token_ids=list(drafts.values()))

    # ------------------------------------------------------------ warm-up
    def warm_up(self) -> float:
        """With ``M3_VNEURON_COMPILE``: every bucket the plugin compiles (W@48000 ``compile_or_warm_up_model``: each
        token bucket x segment size as a one-request prefill, each batch bucket as a decode, R@192000 and R@208000
        synthetic inputs: block tables ``arange(width)``, slots ``arange(tokens)``, decode positions 255), then
        dynamo refuses to recompile: every later shape must be a warmed bucket."""
        if self.compiled is None:
            return 0.0
        t0 = time.perf_counter()
        nc = self.neuron_config
        jobs = [self._synthetic(t, 1, prefill=True) for t in nc.num_batched_tokens_buckets]
        jobs += [self._synthetic(b, b, prefill=False) for b in nc.num_seqs_buckets]
        if self.k:  # R@64000: with drafts, each batch bucket also as a 1 + k verify graph
            jobs += [self._synthetic(b * (1 + self.k), b, prefill=False) for b in nc.num_seqs_buckets]
        for kwargs in jobs:  # inputs built outside inference mode, as at run time (dynamo guards on it)
            with torch.inference_mode():
                self.compiled(**kwargs)
        torch._dynamo.config.error_on_recompile = True
        return time.perf_counter() - t0

    # -------------------------------------------------------------- trace
    def _trace(self, record: dict) -> None:
        """One line of ``$M3_VNEURON_TRACE`` (every rank of a TP group writes its own, with its ``rank``)."""
        if self.trace_path:
            with open(self.trace_path, "a") as f:
                f.write(json.dumps({**record, "rank": int(self.rank_tensor)}) + "\n")
