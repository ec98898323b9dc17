"""The forward calls of the off-device harness, built as ``NeuronModelRunner`` (jinhuang12/vllm-neuron @
ed3580d; ``R@N`` = the character offset of the page of ``vllm_neuron/vllm/worker/neuron_model_runner.py`` where it is,
see ``contract.py``) builds them; :class:`ForwardInputs` is the runner's mixin (:mod:`.runner`).

Each forward gets what the plugin's runner would give it:

* with ``--speculative-config`` (EAGLE3, :mod:`.speculative`), a decode step whose requests all carry drafts is one
  verify forward of ``1 + k`` tokens a row (logits at every token, ``spec_decode_metadata`` vLLM's
  ``SpecDecodeMetadata``, ``logit_mask`` a row a token); where some request has none, the plain decode of all
  (R@320000 ``_local_step_forces_nonspec``); a request with fewer drafts is padded in place (id 0 at the null slot;
  the plugin lays such a batch out compactly, not modelled here);
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
  ``max_query_len``, ``block_size``, ``max_blocks_per_seq``, ``decode_token_threshold`` (1 + k), ``cached_seq_len``
  int32 [1, 1], ``kv_segment_size`` (0 = single-shot prefill), and ``swa_kv_pos_offset`` int32 [reqs] for
  sliding-window groups in decode or with decode context buckets (R@176000).

With ``decode_context_parallel_size`` (DCP) ``> 1`` each rank's slots follow the plugin's
``_compute_slot_mapping_cpu`` (R@0) with interleave = the block size (its caller, R@176000): block ``n`` of a request on
DCP rank ``n mod dcp`` (``cp_rank = tp_rank mod dcp``), other ranks' tokens at slot 0 (the null block); a prefill
segment's slots are cut to this rank's blocks (``view(S // (dcp*bs), dcp, bs)[:, cp_rank]``, R@176000), which needs
the segment to start on a lap of ``dcp`` blocks (the plugin raises otherwise). The plugin's Neuron scheduler runs a
prefill alone with the whole token budget, so its segments always start there; vLLM's scheduler, used here, gives a
segment what the decodes of its step leave, so a segment may start elsewhere: the harness then passes its slots
whole, one per token (the decode form), and notes the deviation in the trace (``dcp_slots``).

Decode padding rows of the block table are -1 here; the plugin leaves whatever its persistent block-table buffer
holds in those rows (stale or null block ids). A model must not let padding rows matter either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .contract import NULL_BLOCK_ID, PAD_SLOT_ID, bucket_for


@dataclass
class Forward:
    """One call of ``model.forward``: its kind, its requests (batch order), and the kwargs it got."""

    kind: str  # "prefill" | "decode" | "verify"
    req_ids: list[str]
    num_tokens: list[int]  # real tokens per request
    first_positions: list[int]
    kwargs: dict = field(default_factory=dict)
    drafts: list[list[int]] = field(default_factory=list)  # a verify step's drafts per request


class ForwardInputs:
    """The forward calls of one engine step (mixed into :class:`.runner.HarnessRunner`: its input batch, requests,
    KV cache config, neuron config and device)."""

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
        ``_compute_slot_mapping_cpu``); under DCP its virtual blocks of ``block_size * dcp`` tokens, this rank's
        ``block_size`` of each (interleave = the block size), other ranks' tokens at the null block."""
        out = []
        w, r = self.dcp
        for bt in self.input_batch.block_table.block_tables:
            bs = bt.block_size
            blocks = bt.block_table.np[row, positions // (bs * w)].astype(np.int64)
            slots = blocks * bs + positions % bs  # interleave = the block: a token's offset in its rank's page
            out.append(np.where(positions // bs % w == r, slots, NULL_BLOCK_ID) if w > 1 else slots)
        return out

    @property
    def dcp(self) -> tuple[int, int]:
        """(decode_context_parallel_size, this rank's place in it: tp_rank mod dcp, R@32000)."""
        w = self.vllm_config.parallel_config.decode_context_parallel_size
        if w == 1:
            return 1, 0
        from vllm.distributed.parallel_state import get_dcp_group

        return w, get_dcp_group().rank_in_group

    def _dcp_prefill_slots(self, slots: list[np.ndarray], computed: int, padded: int) -> list[np.ndarray]:
        """R@176000: a DCP prefill's slot_mapping cut to this rank's blocks of the segment (the segment on a lap of
        ``dcp`` blocks); a segment vLLM's scheduler started elsewhere keeps a slot per token (see the module)."""
        w, r = self.dcp
        out = []
        for s, bt in zip(slots, self.input_batch.block_table.block_tables):
            lap = w * bt.block_size
            if w == 1 or computed % lap or padded % lap:
                out.append(s)
            else:
                out.append(s.reshape(padded // lap, w, bt.block_size)[:, r, :].reshape(-1).copy())
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

    def _logit_mask(self, rows: int, rids: list[str] | tuple[str, ...] = ()):
        """R@160000 ``_build_noop_logit_mask``: None unless structured outputs are enabled; the CPU-sampling path
        applies the grammar to the returned logits (R@240000); with on-device sampling the requests ``rids`` (batch
        order, one row each) take their grammar rows from the scheduler's compact bitmask (R@240000
        ``_get_grammar_bitmask``, :mod:`.scheduler`: packed int32, bit ``t % 32`` of word ``t // 32`` allows token
        ``t``), every other row all True."""
        if not self.neuron_config.enable_structured_outputs:
            return None
        mask = torch.ones(rows, self.vocab_size, dtype=torch.bool)
        so = getattr(self, "_scheduled", None)
        packed = getattr(so, "_grammar_bitmask", None)
        if packed is not None and self.neuron_config.on_device_sampling_config is not None:
            index = {r: i for i, r in enumerate(so._structured_output_request_ids)}
            for j, rid in enumerate(rids):
                if rid in index:
                    words = torch.from_numpy(np.asarray(packed[index[rid]], dtype=np.int32)).to(torch.int64)
                    mask[j] = ((words[:, None] >> torch.arange(32)) & 1).bool().reshape(-1)[: self.vocab_size]
        return mask.to(self.device)

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
        slots = self._dcp_prefill_slots(slots, computed, padded)
        meta = self._metadata(self._group_rows([row], 1), slots, padded, computed, decode=False)
        kwargs = dict(input_ids=ids.to(self.device), positions=pos.to(self.device), attn_metadata=meta,
                      sampling_positions=torch.tensor([n - 1], dtype=torch.int64, device=self.device),
                      sampling_params=self._sampling_params([rid], 1), spec_decode_metadata=None,
                      rank=self.rank_tensor, logit_mask=self._logit_mask(1, [rid]))
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
                      spec_decode_metadata=None, rank=self.rank_tensor, logit_mask=self._logit_mask(padded, rids))
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
                      rank=self.rank_tensor, logit_mask=self._logit_mask(padded * k1))  # R@240000: a row a token
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
                    logit_mask=self._logit_mask(rows if prefill else tokens))

    def _dummy_spec(self, per_row: int, reqs: int, prefill: bool):
        """A verify graph's warm-up ``spec_decode_metadata`` (k drafts a row), None elsewhere."""
        if prefill or per_row == 1:
            return None
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        return SpecDecodeMetadata.make_dummy([[1] * (per_row - 1)] * reqs, self.device)
