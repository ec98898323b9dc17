"""The vLLM Neuron EAGLE3 draft (``vllm_neuron.eagle3``): its fused propose over vLLM's pages against the reference
drafter (``reference.eagle3.Eagle3Drafter``: contiguous cache, slot == position, the catch-up and chain steps of the
host speculative loop, itself graded against transformers' Llama pieces in ``test_eagle3_draft``).

The same draft weights and target states go to both; the paged one gets what the plugin's proposer hands it (the
target call's tokens shifted by one, the sampled tokens ``raw [rows, 1 | 1 + k]`` with ``-1`` after the bonus, pages
in shuffled order, padding rows of -1). Drafted tokens must be equal, float32."""

from __future__ import annotations

import pytest
import torch

from minimax_m3.checkpoint.draft import canonical, synthetic_tensors
from minimax_m3.config.draft import DraftConfig
from minimax_m3.reference.eagle3 import Eagle3Drafter, build_draft
from minimax_m3.ops.paged import slot_mapping
from minimax_m3.vllm_neuron.eagle3 import MiniMaxM3Eagle3Draft, accepted_tokens

DC = DraftConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=64,
                 draft_vocab_size=40, target_hidden_size=24, rms_norm_eps=1e-6, rope_theta=10000.0)
BLOCK, PAGES, WIDTH, K = 4, 24, 6, 3


def _weights():
    tensors = {canonical(k): v.float() for k, v in synthetic_tensors(DC, seed=3).items()}
    g = torch.Generator().manual_seed(4)
    tensors["embed_tokens.weight"] = torch.randn(DC.vocab_size, DC.hidden_size, generator=g)
    return tensors, {"lm_head.weight": torch.randn(DC.vocab_size, DC.hidden_size, generator=g)}


def _paged() -> MiniMaxM3Eagle3Draft:
    tensors, shared = _weights()
    m = MiniMaxM3Eagle3Draft(None, start_layer_idx=5, dtype=torch.float32)
    m.draft, m.vocab_size, m.num_speculative_tokens = build_draft(DC, tensors, shared, torch.float32, "cpu"), 64, K
    shape = (PAGES, DC.num_kv_heads, BLOCK, DC.head_dim)
    m.bind_kv_cache({m.layer_name: [torch.zeros(shape), torch.zeros(shape)]})
    return m


def _reference(rows: int) -> Eagle3Drafter:
    tensors, shared = _weights()
    d = Eagle3Drafter(build_draft(DC, tensors, shared, torch.float32, "cpu"), (1, 2, 3))
    d.reset(rows, WIDTH * BLOCK)
    return d


def _meta(m, table, slots, q):
    return {m.layer_name: {"block_table_tensor": table, "slot_mapping": slots, "block_size": BLOCK,
                           "max_query_len": q, "decode_token_threshold": 1 + K}}


def _slots(table, row, positions):
    return slot_mapping(table[row:row + 1], torch.as_tensor([list(positions)]), BLOCK).view(-1)


def test_prompt_then_verify_steps_propose_the_reference_drafts():
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(PAGES - 1, generator=g)[:2 * WIDTH].add(1).view(2, WIDTH).int()  # page 0: the null page
    m, ref = _paged(), _reference(2)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 6)]
    states = {r: torch.randn(len(p), 3 * 24, generator=g) for r, p in enumerate(prompts)}
    nexts = [int(torch.randint(0, 64, (1,), generator=g)) for _ in prompts]
    drafted = {}
    for r, (p, bonus) in enumerate(zip(prompts, nexts)):  # one prompt segment per forward, as the runner calls
        n = len(p)
        ids = torch.tensor(p[1:] + [p[-1]])  # the proposer's shift: the last token repeated, patched with the bonus
        stacked, only, _ = m(ids, torch.arange(n), states[r], _meta(m, tables[r:r + 1], _slots(tables, r, range(n)), n),
                             torch.tensor([n - 1]), raw_sampled_token_ids=torch.tensor([[bonus]], dtype=torch.int32))
        ref.extend(r, 0, states[r], p[1:])
        want = ref.propose(r, bonus, n, K, lambda j, x: int(x.argmax()))
        assert stacked.tolist() == [[bonus] + want] and only.tolist() == [want], r
        drafted[r] = want
    # a verify step of both rows and a padding row: row 0 accepts 1 draft, row 1 none, then the bonus
    accepted = {0: 1, 1: 0}
    pos0 = {r: len(p) for r, p in enumerate(prompts)}
    ids, positions, slots, hidden, raw = [], [], [], [], []
    for r in (0, 1):
        toks = [nexts[r]] + drafted[r]
        ids += toks
        positions += list(range(pos0[r], pos0[r] + 1 + K))
        slots.append(_slots(tables, r, range(pos0[r], pos0[r] + 1 + K)))
        hidden.append(torch.randn(1 + K, 72, generator=g))
        a = accepted[r]
        raw.append(drafted[r][:a] + [int(torch.randint(0, 64, (1,), generator=g))] + [-1] * (K - a))
    ids += [0] * (1 + K)
    positions += [0] * (1 + K)
    slots.append(torch.full((1 + K,), -1))
    hidden.append(torch.zeros(1 + K, 72))
    raw.append([0] + [-1] * K)
    table = torch.cat([tables, torch.full((1, WIDTH), -1, dtype=torch.int32)])
    last = torch.tensor([K, 1 + 2 * K, 2 + 3 * K])
    stacked, only, _ = m(torch.tensor(ids[1:] + ids[-1:]), torch.tensor(positions), torch.cat(hidden),
                         _meta(m, table, torch.cat(slots), 1 + K), last,
                         raw_sampled_token_ids=torch.tensor(raw, dtype=torch.int32))
    for r in (0, 1):
        a = accepted[r]
        ref.extend(r, pos0[r], hidden[r][:a + 1], drafted[r][:a])
        want = ref.propose(r, raw[r][a], pos0[r] + a + 1, K, lambda j, x: int(x.argmax()))
        assert stacked[r].tolist() == [raw[r][a]] + want and only[r].tolist() == want, r


def test_accepted_tokens_moves_the_sampling_position_back_past_the_rejected():
    ids = torch.arange(12)
    raw = torch.tensor([[7, 8, -1, -1], [9, -1, -1, -1], [1, 2, 3, 4]])
    out, last, bonus = accepted_tokens(ids, torch.tensor([3, 7, 11]), raw, vocab=64, k=3)
    assert last.tolist() == [1, 4, 11] and bonus.tolist() == [8, 9, 4]
    assert out.tolist() == [0, 8, 2, 3, 9, 5, 6, 7, 8, 9, 10, 4]
    out, last, bonus = accepted_tokens(ids[:2], torch.tensor([1]), torch.tensor([[70]]), vocab=64, k=3)
    assert (last.tolist(), bonus.tolist(), out.tolist()) == ([1], [0], [0, 0])  # out of the vocabulary: not valid


@pytest.mark.parametrize("pos,want", [(0, 20), (5, 49), (23, -1), (30, -1)])
def test_slot_mapping(pos, want):
    table = torch.tensor([[5, 12, 3, 9, 2, -1]], dtype=torch.int32)
    assert slot_mapping(table, torch.tensor([pos]), BLOCK).tolist() == [want]
