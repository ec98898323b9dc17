"""The model runner of the off-device harness: vLLM 0.24's scheduler output in, the vLLM Neuron 1.x model contract's
forward calls out, host sampling by vLLM's own sampler (or, with ``on_device_sampling_config``, the model's ids).

Each forward gets what ``NeuronModelRunner`` (jinhuang12/vllm-neuron @ ed3580d; ``R@N`` = the character offset of
the page of ``vllm_neuron/vllm/worker/neuron_model_runner.py`` where it is, see ``contract.py``) would give it:

* with ``--speculative-config`` (EAGLE3, :mod:`.speculative`), a decode step whose requests carry drafts is one
  verify forward of ``1 + k`` tokens a row (logits at every token), and after every forward the draft proposes
  (the plugin's ``EagleProposer.propose``, E@); the drafts go to vLLM's scheduler through ``take_draft_token_ids``;
* one forward per prefill request (the Neuron scheduler admits one prefill at a time and never mixes prefill with
  decode, S@16000/S@32000), its tokens padded to a token bucket; one forward for all decode requests, padded to a
  batch bucket. vLLM's own scheduler (used here unmodified) mixes them in one step, so a step is split: the decode
  forward first, then each prefill forward in the order the scheduler scheduled them. A request scheduled later in
  a step may hit prefix blocks an earlier one fills in that step (it is scheduled after every running request), so
  every cache write it reads happens in an earlier forward;
* ``input_ids`` int32, ``positions`` int64 (prefill padding repeats the last real position, decode padding is 0),
  ``sampling_positions`` int64 (the last real token of each request; padding repeats the last real index),
  ``sampling_params=None`` (host sampling; with on-device sampling float32 ``[rows, 3]`` = (top_k, top_p,
  temperature) per request in batch order, padding rows zero, R@0 ``build_sampling_params_tensor``: defaults -1,
  1.0, 0.0), ``spec_decode_metadata=None``, ``rank`` an int32 scalar tensor,
  ``logit_mask`` None unless ``enable_structured_outputs`` (then all-True, bool, [rows, vocab]);
* ``attn_metadata[layer name]`` for every layer of every KV cache group (the same dict object within a group,
  R@192000): ``block_table_tensor`` int32 [reqs, width] with vLLM's null block shown as -1 (R@0, R@96000),
  ``full_block_table_tensor`` (a clone), ``slot_mapping`` int64 [tokens] (padding slots 0 = the null block),
  ``max_query_len``, ``block_size``, ``max_blocks_per_seq``, ``decode_token_threshold`` (1), ``cached_seq_len``
  int32 [1, 1], ``kv_segment_size`` (0 = single-shot prefill), and ``swa_kv_pos_offset`` int32 [reqs] for
  sliding-window groups in decode or with decode context buckets (R@176000).

Decode padding rows of the block table are -1 here; the plugin leaves whatever its persistent block-table buffer
holds in those rows (stale or null block ids). A model must not let padding rows matter either way.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from . import contract
from .contract import NULL_BLOCK_ID, PAD_SLOT_ID, bucket_for

log = logging.getLogger(__name__)


@dataclass
class Forward:
    """One call of ``model.forward``: its kind, its requests (batch order), and the kwargs it got."""

    kind: str  # "prefill" | "decode" | "verify"
    req_ids: list[str]
    num_tokens: list[int]  # real tokens per request
    first_positions: list[int]
    kwargs: dict = field(default_factory=dict)
    drafts: list[list[int]] = field(default_factory=list)  # a verify step's drafts per request


class HarnessRunner:
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

    # ------------------------------------------------------------- inputs
    def _group_rows(self, rows: list[int], padded_rows: int) -> list[torch.Tensor]:
        """Per KV cache group: the block-table rows of ``rows`` (batch indices), null block -> -1 (R@0), padded to
        ``padded_rows`` with all -1 rows."""
        out = []
        for bt in self.input_batch.block_table.block_tables:
            table = bt.block_table.cpu[rows].clone()
            table = torch.where(table == NULL_BLOCK_ID, torch.full_like(table, PAD_SLOT_ID), table)
            if padded_rows > len(rows):
                pad = torch.full((padded_rows - len(rows), table.shape[1]), PAD_SLOT_ID, dtype=table.dtype)
                table = torch.cat([table, pad])
            out.append(table.contiguous())
        return out

    def _slots(self, row: int, positions: np.ndarray) -> list[np.ndarray]:
        """Per group: block_table[position // block_size] * block_size + position % block_size (R@0
        ``_compute_slot_mapping_cpu``, one rank)."""
        out = []
        for bt in self.input_batch.block_table.block_tables:
            blocks = bt.block_table.np[row, positions // bt.block_size].astype(np.int64)
            out.append(blocks * bt.block_size + positions % bt.block_size)
        return out

    def _metadata(self, tables, slots, max_query_len, cached_seq_len, decode, ctx_len=(), full_tables=None) -> dict:
        """R@176000 ``_build_attention_metadata``: one dict per KV cache group, keyed by each of its layer names."""
        from vllm.v1.kv_cache_interface import SlidingWindowSpec, UniformTypeKVCacheSpecs

        nc = self.neuron_config
        kv_segment_size = nc.kv_segment_size_buckets[0] if nc.kv_segment_size_buckets else 0
        meta = {}
        for gi, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec, bs = group.kv_cache_spec, group.kv_cache_spec.block_size
            table = tables[gi]
            full = table.clone() if full_tables is None else full_tables[gi]
            rows = table.shape[0]
            swa_offset = None
            sliding = None if isinstance(spec, UniformTypeKVCacheSpecs) else getattr(spec, "sliding_window", None)
            if decode and isinstance(spec, SlidingWindowSpec):  # R@176000 _compute_swa_decode_tensors
                per_tile = max(128 // bs, 1)
                need = sliding // bs + 1
                n = min((need + per_tile - 1) // per_tile * per_tile, -(-self.max_model_len // bs))
                if n < table.shape[1]:
                    ctx = torch.tensor(ctx_len + [0] * (rows - len(ctx_len)), dtype=torch.int64)
                    start = torch.clamp(ctx // bs - n + 1, min=0)
                    table = torch.gather(full, 1, start[:, None] + torch.arange(n)[None, :])
                    swa_offset = (start * bs).to(torch.int32)
                else:
                    swa_offset = torch.zeros(rows, dtype=torch.int32)
            elif decode and nc.decode_context_length_buckets is not None:  # R@176000 ctx-bucket trim
                need = max(ctx_len, default=0) + 1
                ctx_bucket = bucket_for(need, nc.decode_context_length_buckets + [self.max_model_len])
                n = -(-ctx_bucket // bs)
                if n < table.shape[1]:
                    table = torch.index_select(table, 1, torch.arange(n))
                swa_offset = torch.zeros(rows, dtype=torch.int32)
            m = {
                "block_table_tensor": table.to(self.device),
                "slot_mapping": torch.from_numpy(slots[gi]).to(torch.int64).to(self.device),
                "max_query_len": int(max_query_len),
                "block_size": int(bs),
                "max_blocks_per_seq": int(table.shape[1]),
                "decode_token_threshold": 1 + self.k,  # 1 + max_num_draft_tokens (R@176000)
                "cached_seq_len": torch.tensor([[cached_seq_len]], dtype=torch.int32, device=self.device),
                "kv_segment_size": int(kv_segment_size),
                "full_block_table_tensor": full.to(self.device),
            }
            if swa_offset is not None:
                m["swa_kv_pos_offset"] = swa_offset.to(self.device)
            for name in group.layer_names:
                meta[name] = m
        return meta

    def _logit_mask(self, rows: int):
        """R@160000 ``_build_noop_logit_mask``: None unless structured outputs are enabled; the CPU-sampling path
        applies the grammar to the returned logits (R@240000)."""
        if not self.neuron_config.enable_structured_outputs:
            return None
        return torch.ones(rows, self.vocab_size, dtype=torch.bool, device=self.device)

    def _sampling_params(self, rids: list[str], rows: int):
        """R@0 ``build_sampling_params_tensor``: None without on-device sampling; else float32 ``[rows, 3]`` =
        (top_k, top_p, temperature) of each request (vLLM's SamplingParams; top_k <= 0 off, temperature 0 greedy),
        padded with zero rows (R@304000)."""
        if self.neuron_config.on_device_sampling_config is None:
            return None
        out = torch.zeros(rows, 3, dtype=torch.float32)
        for i, rid in enumerate(rids):
            sp = self.requests[rid].sampling_params
            out[i] = torch.tensor([float(sp.top_k if sp.top_k and sp.top_k > 0 else -1), float(sp.top_p),
                                   float(sp.temperature)])
        return out.to(self.device)

    def _prefill(self, row: int, rid: str, n: int) -> Forward:
        """R@112000..R@160000 for a one-request batch: tokens padded to the token bucket the Neuron scheduler picks
        (S@16000 ``_calculate_padded_count``), padding ids 0, padding positions = the last real position, padding
        slots 0 (the null block); sampling position = the last real token; cached_seq_len = tokens already
        computed."""
        ib = self.input_batch
        computed = int(ib.num_computed_tokens_cpu[row])
        padded = bucket_for(n, self.neuron_config.num_batched_tokens_buckets)
        if padded < n:
            raise RuntimeError(f"{n} prefill tokens exceed the largest token bucket {padded}")
        positions = computed + np.arange(n, dtype=np.int64)
        ids = torch.from_numpy(ib.token_ids_cpu[row, positions].astype(np.int32))
        pos = torch.from_numpy(positions)
        slots = self._slots(row, positions)
        if padded > n:
            ids = torch.cat([ids, torch.zeros(padded - n, dtype=torch.int32)])
            pos = torch.cat([pos, torch.full((padded - n,), int(positions[-1]), dtype=torch.int64)])
            slots = [np.concatenate([s, np.full(padded - n, NULL_BLOCK_ID, dtype=np.int64)]) for s in slots]
        meta = self._metadata(self._group_rows([row], 1), slots, padded, computed, decode=False)
        kwargs = dict(input_ids=ids.to(self.device), positions=pos.to(self.device), attn_metadata=meta,
                      sampling_positions=torch.tensor([n - 1], dtype=torch.int64, device=self.device),
                      sampling_params=self._sampling_params([rid], 1), spec_decode_metadata=None,
                      rank=self.rank_tensor, logit_mask=self._logit_mask(1))
        return Forward("prefill", [rid], [n], [computed], kwargs)

    def _decode(self, rows: list[int], rids: list[str]) -> Forward:
        """R@112000..R@176000 for a decode batch: one token per request, the batch padded to the batch bucket
        (``get_decode_padded_batch_size``), ids and positions padded with 0 (``_pad_to_compiled_shapes``), slots
        with 0 (``_apply_decode_slot_mapping_padding``), sampling positions with the last real index;
        cached_seq_len = the most tokens any of them has computed (``_compute_cached_seq_len``)."""
        ib = self.input_batch
        k = len(rows)
        padded = bucket_for(k, self.neuron_config.num_seqs_buckets)
        computed = [int(ib.num_computed_tokens_cpu[r]) for r in rows]
        positions = np.array(computed, dtype=np.int64)
        ids = torch.tensor([int(ib.token_ids_cpu[r, p]) for r, p in zip(rows, computed)], dtype=torch.int32)
        per_req = [self._slots(r, positions[i:i + 1]) for i, r in enumerate(rows)]
        slots = [np.concatenate([s[g] for s in per_req]) for g in range(len(per_req[0]))]
        pos = torch.from_numpy(positions)
        sample = torch.arange(k, dtype=torch.int64)
        if padded > k:
            ids = torch.cat([ids, torch.zeros(padded - k, dtype=torch.int32)])
            pos = torch.cat([pos, torch.zeros(padded - k, dtype=torch.int64)])
            slots = [np.concatenate([s, np.full(padded - k, NULL_BLOCK_ID, dtype=np.int64)]) for s in slots]
            sample = torch.cat([sample, torch.full((padded - k,), k - 1, dtype=torch.int64)])
        meta = self._metadata(self._group_rows(rows, padded), slots, 1, max(computed), decode=True, ctx_len=computed)
        kwargs = dict(input_ids=ids.to(self.device), positions=pos.to(self.device), attn_metadata=meta,
                      sampling_positions=sample.to(self.device), sampling_params=self._sampling_params(rids, padded),
                      spec_decode_metadata=None, rank=self.rank_tensor, logit_mask=self._logit_mask(padded))
        return Forward("decode", rids, [1] * k, computed, kwargs)

    def _verify(self, rows: list[int], rids: list[str], drafts: list[list[int]]) -> Forward:
        """A decode batch with drafts (R@128000/R@144000 ``_build_spec_decode_metadata``, padded to the batch bucket):
        each request's last token and its drafts, ``1 + k`` tokens a row (a request with fewer drafts padded with id
        0 at the null slot), ``max_query_len`` = ``decode_token_threshold`` = ``1 + k``, logits at every token."""
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        ib = self.input_batch
        k1, n = 1 + self.k, len(rows)
        padded = bucket_for(n, self.neuron_config.num_seqs_buckets)
        computed = [int(ib.num_computed_tokens_cpu[r]) for r in rows]
        groups = len(ib.block_table.block_tables)
        ids, pos, slots = [], [], [[] for _ in range(groups)]
        for r, c, d in zip(rows, computed, drafts):
            real = 1 + len(d)
            ids += [int(ib.token_ids_cpu[r, c])] + list(d) + [0] * (k1 - real)
            pos += list(range(c, c + k1))
            for g, got in enumerate(self._slots(r, np.arange(c, c + real, dtype=np.int64))):
                slots[g].append(np.concatenate([got, np.full(k1 - real, NULL_BLOCK_ID, dtype=np.int64)]))
        for g in range(groups):
            slots[g].append(np.full((padded - n) * k1, NULL_BLOCK_ID, dtype=np.int64))
        ids += [0] * ((padded - n) * k1)
        pos += [0] * ((padded - n) * k1)
        slots = [np.concatenate(s) for s in slots]
        meta = self._metadata(self._group_rows(rows, padded), slots, k1, max(computed), decode=True, ctx_len=computed)
        kwargs = dict(input_ids=torch.tensor(ids, dtype=torch.int32, device=self.device),
                      positions=torch.tensor(pos, dtype=torch.int64, device=self.device), attn_metadata=meta,
                      sampling_positions=torch.arange(padded * k1, dtype=torch.int64, device=self.device),
                      sampling_params=self._sampling_params(rids, padded),
                      spec_decode_metadata=SpecDecodeMetadata.make_dummy(drafts, self.device),
                      rank=self.rank_tensor, logit_mask=self._logit_mask(padded))
        return Forward("verify", rids, [1 + len(d) for d in drafts], computed, kwargs, [list(d) for d in drafts])

    def _plan(self, so) -> list[tuple[Forward, list[int]]]:
        ib = self.input_batch
        decode_rows, decode_ids, decode_drafts, prefills = [], [], [], []
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        for rid, n in so.num_scheduled_tokens.items():  # scheduling order
            row = ib.req_id_to_index[rid]
            st = self.requests[rid]
            drafts = list(spec.get(rid, ()))
            if ib.num_computed_tokens_cpu[row] < st.num_prompt_tokens or n > 1 + len(drafts):
                prefills.append((row, rid, n))  # R@288000 _is_decode_row; more past the prompt: a resumed request
            else:
                decode_rows.append(row)
                decode_ids.append(rid)
                decode_drafts.append(drafts)
        plan = []
        if decode_rows:
            order = sorted(range(len(decode_rows)), key=lambda i: decode_rows[i])  # batch order
            rows = [decode_rows[i] for i in order]
            rids = [decode_ids[i] for i in order]
            if all(decode_drafts):  # R@320000 _local_step_forces_nonspec: a request without drafts strips the step
                plan.append((self._verify(rows, rids, [decode_drafts[i] for i in order]), rows))
            else:
                plan.append((self._decode(rows, rids), rows))
        for row, rid, n in prefills:
            plan.append((self._prefill(row, rid, n), [row]))
        return plan

    # ----------------------------------------------------------- execute
    def execute_model(self, so):
        self.step += 1
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
                "input_ids_shape": list(fwd.kwargs["input_ids"].shape),
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

    def _synthetic(self, tokens: int, reqs: int, prefill: bool) -> dict:
        tables, fulls, slots = [], [], []
        for bt in self.input_batch.block_table.block_tables:
            width = bt.block_table.cpu.shape[1]  # InputBatch's width: cdiv(max_model_len, bs), 128/bs-aligned
            tables.append(torch.arange(width, dtype=torch.int32)[None, :].expand(reqs, -1).contiguous())
            # R@192000: the full table is cdiv(max_model_len, bs) wide, *not* aligned (a model that reads it can
            # see a wider one at run time than at warm-up)
            full = -(-self.max_model_len // bt.block_size)
            fulls.append(torch.arange(full, dtype=torch.int32)[None, :].expand(reqs, -1).contiguous())
            slots.append(np.arange(tokens, dtype=np.int64))
        if prefill:
            ids = torch.arange(1, tokens + 1, dtype=torch.int32) % self.vocab_size  # R@192000: arange(1, n+1)
            pos = torch.arange(tokens, dtype=torch.int64)
            sample = torch.tensor([tokens - 1], dtype=torch.int64)
        else:
            ids = torch.ones(tokens, dtype=torch.int32)
            pos = torch.full((tokens,), 255, dtype=torch.int64)  # context_len 256 (W@64000)
            sample = torch.arange(tokens, dtype=torch.int64)
        meta = self._metadata(tables, slots, tokens // reqs, 0, decode=not prefill, ctx_len=[0] * reqs,
                              full_tables=fulls)
        rows = 1 if prefill else reqs
        ods = None if self.neuron_config.on_device_sampling_config is None else \
            torch.tensor([[0.0, 1.0, 1.0]]).expand(rows, 3).contiguous()  # W@64000's warm-up row, per row
        return dict(input_ids=ids, positions=pos, attn_metadata=meta, sampling_positions=sample,
                    sampling_params=ods, spec_decode_metadata=self._dummy_spec(tokens // reqs, reqs, prefill),
                    rank=self.rank_tensor,
                    logit_mask=self._logit_mask(rows))

    def _dummy_spec(self, per_row: int, reqs: int, prefill: bool):
        """A verify graph's warm-up ``spec_decode_metadata`` (k drafts a row), None elsewhere."""
        if prefill or per_row == 1:
            return None
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        return SpecDecodeMetadata.make_dummy([[1] * (per_row - 1)] * reqs, self.device)

    # -------------------------------------------------------------- trace
    def _trace(self, record: dict) -> None:
        if self.trace_path:
            with open(self.trace_path, "a") as f:
                f.write(json.dumps(record) + "\n")
