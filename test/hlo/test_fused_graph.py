"""The fused speculation graph at real widths (issue 24): NxDI's ``fused_speculation_model`` of a build with an EAGLE3
draft inside the graph (``--fused-speculation --on-device-sampling``) against the one-token step and the (host-draft)
verify step of the same shapes, rank 0 of TP 64 / EP 64 / LNC 2, real M3 widths, bf16, the port's sharded caches.

The shapes of ``test_verify_graph`` (1 dense + 2 sparse MoE layers, batch 4, cache bucket 4096, k = 3 drafts:
``speculation_length`` T = 4); DIR holds only the synthetic M3-width EAGLE3 draft's ``config.json``
(``checkpoint.draft.synthetic_config``: hidden H = 6144, 48 MHA heads of 128, MLP 12288, vocabulary V = 200064 with a
100032-token draft vocabulary). A dry run reads no draft tensor (NxDI's trace builds the draft from its config; only
loading reads ``M3Eagle3DraftForCausalLM.get_state_dict``). One fused step (``NeuronFusedSpecModel.
_eagle_token_gen_forward``) runs ``T - 1 = 3`` one-token draft steps in sequence (each step's token is the next one's
input), the target's verify of the ``T`` tokens, a draft catch-up over them (its K/V only: its token and attention
output are unused, so the traced graph holds its K/V side alone) and the greedy acceptance.

Per rank, written out by hand (bf16 = 2 B; NxD shards the embeddings along hidden, 6144 / 64 = 96 columns; the head
over the vocabulary padded to 64 x 3126; the draft's 48 heads over 64 ranks: NxDI's ``CONVERT_TO_MHA`` pads them to
64, one head of 128 per rank):

* the draft's tensors: fc ``[96, 3H]``; q, k, v ``[128, 2H]`` each; o ``[H, 128]``; gate, up ``[192, H]``, down
  ``[H, 192]``; 4 norms ``[H]`` (input, hidden, post-attention, final); lm_head ``[3126, H]`` + bias ``[3126]``: the
  reduced vocabulary is folded into a full-vocabulary head with a masking bias (``neuron.eagle``), so each draft
  step reads ``V x H``, not ``Vd x H``; the embedding ``[V, 96]`` (rows only);
* the weights a fused step reads: the target's once, as the verify step's (the one-token step's + 12 more tokens'
  embedding rows); the draft's ONCE PER DRAFT CALL in which they are live: the 3 draft steps read every draft
  tensor; the catch-up reads k, v, fc and the input and hidden norms again; fc is read by the first step and the
  catch-up only (the later steps feed the draft's own H-wide state, not the target's 3H); embedding rows: 3 x 4 +
  16 tokens. The draft steps are sequential, so no schedule reads the draft's weights fewer than 3 times per step;
  the graph reads no more than that. The lm_head is 63 % of it;
* the target's state reads: ``test_verify_graph``'s (dense K/V and index keys once per row, each query its 16
  selected blocks), equal to its verify graph's figure for figure; no state copies;
* the draft's state reads: each draft step attends over its rows' whole cache bucket (dense MHA): K and V
  ``[4, 1, 4096, 128]`` read 3 times; the rolling buffer of the target states, one ``3H`` state per row;
* dot FLOPs: the target's as the verify step's; the draft's linear layers per call as above (2 x tokens x the
  weight's elements), its attention over the bucket's 4096 keys and its own in each step;
* the collectives, op by op (below).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import REASON, collective_ops, draft_and_target, dry_run
from .test_verify_graph import ARGS, B, BUCKET, K, T, _config

FUSED = "fused_speculation_model"
H, V, TP = 6144, 200064, 64
COLS, ROWS = H // TP, 3126  # the embedding's columns on a rank; the head's vocabulary rows (200064 / 64)
# the draft's tensors on rank 0: (shape, reads per fused step); "embed" read by rows (below)
DRAFT = {
    "fc.weight": ((COLS, 3 * H), 2),
    "layers.0.self_attn.qkv_proj.q_proj.weight": ((128, 2 * H), 3),
    "layers.0.self_attn.qkv_proj.k_proj.weight": ((128, 2 * H), 4),
    "layers.0.self_attn.qkv_proj.v_proj.weight": ((128, 2 * H), 4),
    "layers.0.self_attn.o_proj.o_proj.weight": ((H, 128), 3),
    "layers.0.mlp.gate_proj.weight": ((12288 // TP, H), 3),
    "layers.0.mlp.up_proj.weight": ((12288 // TP, H), 3),
    "layers.0.mlp.down_proj.weight": ((H, 12288 // TP), 3),
    "layers.0.input_layernorm.weight": ((H,), 4),
    "layers.0.hidden_norm.weight": ((H,), 4),
    "layers.0.post_attention_layernorm.weight": ((H,), 3),
    "norm.weight": ((H,), 3),
    "lm_head.weight": ((ROWS, H), 3),
    "lm_head.bias": ((ROWS,), 3),
    "embed_tokens.weight": ((V, COLS), None),
}
EMBED_ROWS = (T - 1) * B + T * B  # 3 draft steps of 4 rows, the catch-up's 16 tokens
DRAFT_KV = 2 * B * 1 * BUCKET * 128 * 2  # K and V, one head per rank
PROMPT = 128  # the context bucket (ARGS)
RANK_ID = 4  # the target's rank id (int32 [1]), read again by the seeded sampler of an on-device-sampling build


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _graph(rep: dict, submodel: str) -> dict:
    return next(g for g in rep["graphs"] if g["submodel"] == submodel)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{"plain", "verify", "fused", "chunked"} reports (the first two: ``test_verify_graph``'s runs, shared through the
    trace cache; "chunked": the fused build with prompts of up to 256 tokens prefilled in calls of 128); "fused_dir":
    the fused dry run's directory."""
    if REASON:
        pytest.skip(REASON)
    from minimax_m3.graphs import report as graphs

    draft, model = draft_and_target(tmp_path_factory, _config())
    spec = ARGS + ["--speculative-tokens", str(K)]
    dirs = {"plain": dry_run(model, tmp_path_factory.mktemp("dry") / "plain", ARGS),
            "verify": dry_run(model, tmp_path_factory.mktemp("dry") / "draft", spec, draft),
            "fused": dry_run(model, tmp_path_factory.mktemp("dry") / "fused",
                             spec + ["--fused-speculation", "--on-device-sampling"], draft),
            "chunked": dry_run(model, tmp_path_factory.mktemp("dry") / "chunked",
                               spec + ["--fused-speculation", "--on-device-sampling", "--max-context-len",
                                       str(2 * PROMPT), "--prefill-chunk", str(PROMPT)], draft)}
    out = {k: graphs.analyze_dir(d, write=False) for k, d in dirs.items()}
    out["fused_dir"] = dirs["fused"]
    return out


def _draft_reads(builds, submodel: str) -> dict[str, tuple[tuple, int]]:
    """The draft's tensors in ``submodel``'s module: name (without ``draft_model.``) -> (shape, bytes read)."""
    from minimax_m3.graphs import hlo_cost, hlo_schema

    root = Path(builds["fused_dir"])
    man = json.loads((root / "dry_run.json").read_text())
    g = next(g for g in man["graphs"] if g["submodel"] == submodel)
    module = hlo_schema.parse_module((root / g["hlo"]).read_bytes())
    params, reads = hlo_cost.entry_parameters(module), hlo_cost.analyze_module(module)["reads"]
    return {p["name"][len("draft_model."):]: (tuple(params[p["number"]].dimensions), reads.get(p["number"], 0))
            for p in g["params"] if p["role"] == "weight" and p["name"].startswith("draft_model.")}


def test_the_fused_build_has_its_two_graphs(builds):
    rep = builds["fused"]
    assert {g["submodel"] for g in rep["graphs"]} == {"context_encoding_model", FUSED}
    g = _graph(rep, FUSED)
    assert (g["bucket"], g["batch"], g["tokens"]) == (BUCKET, B, T)  # the target verifies T tokens per row
    man = json.loads((Path(rep["dir"]) / "dry_run.json").read_text())
    assert man["speculation_length"] == T and man["aux_hidden_layers"] == [0, 1, 2]
    assert next(m for m in man["graphs"] if m["submodel"] == FUSED)["tokens"] == 1  # the call takes the last token
    assert rep["layout"]["kv_layout"] == "sharded" and rep["layout"]["kv_group"] == 16


def test_the_target_reads_its_weights_once(builds):
    """The fused step's target weights are the verify step's (the one-token step's plus the 12 more tokens'
    embedding rows) and the 4 bytes of the rank id (int32) the seeded sampler reads once more (its distributed
    top-k's vocabulary offset): <= 1.05 x the one-token step's, the issue's target."""
    one = _graph(builds["plain"], "token_generation_model")["bytes_read"]["weights"]
    verify = _graph(builds["verify"], "speculation_model")["bytes_read"]["weights"]
    fused = _graph(builds["fused"], FUSED)["bytes_read"]["weights"]
    assert verify == one + 12 * COLS * 2 and fused == verify + RANK_ID, (fused, verify, one)
    assert fused <= 1.05 * one


def test_the_draft_weights_by_hand(builds):
    """Every draft tensor on rank 0 has the hand shape and is read as many times as the draft calls in which it is
    live (module docstring): 3 draft steps, the catch-up's K/V side, fc twice, the embedding by rows."""
    got = _draft_reads(builds, FUSED)
    assert set(got) == set(DRAFT)
    for name, (shape, times) in DRAFT.items():
        gshape, read = got[name]
        assert gshape == shape, (name, gshape, shape)
        want = EMBED_ROWS * COLS * 2 if times is None else times * _numel(shape) * 2
        assert read == want, (name, read, want)
    total = sum(r for _, r in got.values())
    assert total == _graph(builds["fused"], FUSED)["draft"]["weights"]
    assert total == 183_066_180  # 3 x 50,239,596 (a draft step) + 4 x 6,316,032 (k, v, 2 norms) + 2 x fc + rows
    head = got["lm_head.weight"][1] + got["lm_head.bias"][1]
    assert 0.62 < head / total < 0.63  # the full-vocabulary head (the folded d2t) is most of it


def test_the_prefill_graph_reads_only_the_drafts_kv_side(builds):
    """Context encoding writes the draft's K/V of the prompt (its token is unused): k, v, fc, the input and hidden
    norms once, the prompt's 128 embedding rows; the target's weights as the plain build's prefill (and the
    sampler's rank id)."""
    got = _draft_reads(builds, "context_encoding_model")
    live = {n: DRAFT[n][0] for n in ("fc.weight", "layers.0.self_attn.qkv_proj.k_proj.weight",
                                     "layers.0.self_attn.qkv_proj.v_proj.weight", "layers.0.input_layernorm.weight",
                                     "layers.0.hidden_norm.weight")}
    assert {n: s for n, (s, _) in got.items() if n != "embed_tokens.weight"} == live
    assert {n: r for n, (_, r) in got.items()} == {**{n: _numel(s) * 2 for n, s in live.items()},
                                                    "embed_tokens.weight": 128 * COLS * 2}
    ctx = _graph(builds["fused"], "context_encoding_model")
    assert ctx["draft"]["weights"] == 9_879_552
    plain = _graph(builds["plain"], "context_encoding_model")["bytes_read"]["weights"]
    assert ctx["bytes_read"]["weights"] == plain + RANK_ID


def test_state_bytes_by_hand(builds):
    """The target's: the verify step's figure for figure (<= 1.1 x the hand minima); the draft's: its cache read by
    each of the 3 draft steps, one target state per row from the rolling buffer; no state copies."""
    g, verify = _graph(builds["fused"], FUSED), _graph(builds["verify"], "speculation_model")
    slots = BUCKET // 16
    want = {"kv_dense": B * slots * 128 * 2 * 2, "index_k": 2 * B * slots * 128 * 2,
            "kv_sparse": 2 * B * T * 16 * 8 * 128 * 2 * 2}
    for kind, n in want.items():
        assert n <= g["bytes_read"][kind] <= 1.1 * n, (kind, g["bytes_read"][kind], n)
        assert g["bytes_read"][kind] == verify["bytes_read"][kind]
    assert g["gathered_kv"] == want["kv_sparse"]
    assert {k: g["analytic"]["bytes_read"][k] for k in want} == want
    assert g["draft"]["kv"] == 3 * DRAFT_KV == 25_165_824
    assert g["draft"]["states"] == B * 3 * H * 2
    assert sum(g["state_copies"].values()) == g["draft"]["state_copies"] == 0


def test_fused_collectives_by_hand(builds):
    """Op by op. Each draft step (4 tokens): the embedding all-gather, the attention and MLP all-reduces, NxD's
    distributed argmax (each rank's max and index, gathered); fc gathers its output in the first step and the
    catch-up. The catch-up (16 tokens): its embedding and fc all-gathers (no all-reduce: its outputs are unused).
    The target: the verify step's (``test_verify_graph``) without the logits all-gather (on-device sampling), and
    the seeded sampler's distributed top-256 (NxD's 3-stage top-k over 4 x 16 rank groups: traced here with NxD's
    ``TopK`` path, the harness's stand-in for the NKI top-k kernel, whose collectives on trn2 may differ)."""
    n, t1 = B * T, B
    g = _graph(builds["fused"], FUSED)
    assert collective_ops(g) == {
        # the 3 draft steps
        ("all-gather", "bf16", (H, 1, B), H * t1 * 2, "tp"): 3 + 1,  # embedding x 3, fc in the first step
        ("all-reduce", "bf16", (B, 1, H), t1 * H * 2, "tp"): 3 * 2,
        ("all-gather", "f32", (64, 1, B), 64 * t1 * 4, "tp"): 3,  # argmax: each rank's max
        ("all-gather", "s64", (64, 1, B), 64 * t1 * 8, "tp"): 3,  # and its index
        # the target's embedding, the catch-up's embedding and fc
        ("all-gather", "bf16", (H, T, B), H * n * 2, "tp"): 3,
        # the target's verify of the 16 tokens
        ("all-gather", "bf16", (16, B, T, 128), 16 * n * 128 * 2, "kv"): 1,
        ("all-gather", "f32", (16, B, T, 160), 16 * n * 160 * 4, "kv"): 2,
        ("all-to-all", "f32", (16, B, 1, T, 130), 16 * n * 130 * 4, "kv"): 3,
        ("all-reduce", "bf16", (B, T, H), n * H * 2, "tp"): 6,
        # the target's sampler: 3 stages of (values, ids) over 64 x 16 candidates
        ("all-gather", "f32", (64 * n, 16), 64 * n * 16 * 4, "?"): 3,
        ("all-gather", "s32", (64 * n, 16), 64 * n * 16 * 4, "?"): 3,
    }
    assert sum(collective_ops(g).values()) == 37  # 18 the draft's, 19 the target's


def test_fused_against_the_one_token_and_verify_steps(builds):
    """The figures side by side (docs/results.md), per rank: the target's one-token step, its verify step (host
    draft), the fused step's target and draft parts, and the fused step against its minimum (the target's verify +
    the draft's per-call reads)."""
    one = _graph(builds["plain"], "token_generation_model")
    verify = _graph(builds["verify"], "speculation_model")
    fused = _graph(builds["fused"], FUSED)
    stored = sum(_numel(s) * 2 for s, _ in DRAFT.values())
    once = stored - V * COLS * 2 + EMBED_ROWS * COLS * 2  # every draft tensor read once, the embedding by rows
    rows = [("target weights (B)", one["bytes_read"]["weights"], verify["bytes_read"]["weights"],
             fused["bytes_read"]["weights"]),
            ("draft weights (B)", 0, 0, fused["draft"]["weights"]),
            ("target K/V + index-K (B)", sum(one["bytes_read"].values()) - one["bytes_read"]["weights"],
             sum(verify["bytes_read"].values()) - verify["bytes_read"]["weights"],
             sum(fused["bytes_read"].values()) - fused["bytes_read"]["weights"]),
            ("draft K/V (B)", 0, 0, fused["draft"]["kv"]),
            ("target states read (B)", 0, 0, fused["draft"]["states"]),
            ("dot FLOPs", sum(one["flops"].values()), sum(verify["flops"].values()), sum(fused["flops"].values())),
            ("collectives", len(one["collective_ops"]), len(verify["collective_ops"]),
             len(fused["collective_ops"])),
            ("collective bytes", sum(o["bytes"] for o in one["collective_ops"]),
             sum(o["bytes"] for o in verify["collective_ops"]), sum(o["bytes"] for o in fused["collective_ops"])),
            ("HLO instructions", one["instructions"], verify["instructions"], fused["instructions"])]
    print(f"\nper rank, batch {B}, bucket {BUCKET}, 1 dense + 2 sparse MoE layers, k = {K}:"
          f"{'one-token':>14} {'verify':>14} {'fused':>14}")
    for label, a, b, c in rows:
        print(f"  {label:<26} {a:>16,} {b:>14,} {c:>14,}")
    total = fused["bytes_read"]["weights"] + fused["draft"]["weights"]
    print(f"  draft weights stored on the rank {stored:,}; read once each (embedding by rows) {once:,}; "
          f"read by the fused step {fused['draft']['weights']:,} ({fused['draft']['weights'] / once:.3f} x)")
    print(f"  fused step weights {total:,} = {total / one['bytes_read']['weights']:.3f} x the one-token step's, "
          f"{total / (one['bytes_read']['weights'] + once):.3f} x (one-token + draft read once)")
    assert stored == 98_506_860 and once == 60_099_948
    # FLOPs: the target's as the verify step's; the draft's written out (t tokens through an [n, m] weight: 2 t n m)
    fv, ff = verify["flops"], fused["flops"]
    assert (ff["routed_experts"], ff["indexer"]) == (fv["routed_experts"], fv["indexer"])
    # each draft step: 4 queries of its one head over the bucket's 4096 keys and its own, QK and PV
    assert ff["attention"] - fv["attention"] == (T - 1) * B * 2 * 2 * (BUCKET + 1) * 128 == 25_171_968
    step = 2 * B * (3 * 2 * H * 128 + 128 * H + 3 * H * 192 + H * ROWS)  # q, k, v, o, MLP, lm_head
    catch_up = 2 * B * T * (3 * H * COLS + 2 * 2 * H * 128)  # fc, k, v
    rope = (T - 1) * 2 * B * 64 + 2 * B * T * 64  # the draft's RoPE angles (64 frequencies x positions)
    assert ff["rest"] - fv["rest"] == (T - 1) * step + 2 * B * 3 * H * COLS + catch_up + rope == 849_448_448
    assert total == verify["bytes_read"]["weights"] + RANK_ID + 183_066_180
    # the excess over "target once + draft once" is the 2 more draft steps and the catch-up, nothing else
    assert total - (one["bytes_read"]["weights"] + once) == 183_066_180 - once + 12 * COLS * 2 + RANK_ID


def test_a_prefill_in_calls_costs_the_draft_what_one_call_does_and_one_state_shift(builds):
    """Prompts longer than a call (``--prefill-chunk 128 --max-context-len 256``): one context-encoding graph for
    every call (the call's first position is an input; ``neuron.eagle.M3FusedSpecModel``). The draft's weights read
    as the one-call build's (its K/V side), its cache written in place, the target's caches too (a sparse layer
    reads its K/V lines through one copy with the call's keys in their slots: the line, a few hundred KiB). What the
    calls add: two target states per row from the rolling buffer (the previous call's last; the kept one of a row
    whose prompt ended earlier) and ONE pass over the call's target states, shifted by one position for the draft
    (``[B, T, 3H]`` bf16: the minimum for a shift; NxDI's one-call prefill shifts the tokens instead, which across
    calls would leave the previous call's last entry without its token)."""
    one = _graph(builds["fused"], "context_encoding_model")
    chunked = _graph(builds["chunked"], "context_encoding_model")
    b = chunked["batch"]
    print(f"\nchunked fused prefill, batch {b}: draft {chunked['draft']}; one call {one['draft']}")
    assert (chunked["bucket"], chunked["tokens"]) == (one["bucket"], one["tokens"]) == (PROMPT, PROMPT)
    assert chunked["draft"]["weights"] == one["draft"]["weights"] == 9_879_552
    assert chunked["draft"]["kv"] == one["draft"]["kv"] == 0
    assert chunked["draft"]["states"] == 2 * b * 3 * H * 2
    # the target's caches are written in place; a sparse layer's attention reads its K and V lines through one copy
    # each with the call's own keys in their slots (ops.step._sparse: the call's keys by selected block, not densely)
    assert chunked["state_copies"] == {"kv_dense": 0, "kv_sparse": 2 * 2, "index_k": 0}
    assert chunked["state_copy_bytes"]["kv_sparse"] == 2 * 2 * b * (BUCKET // 16) * 128 * 2
    shift = b * PROMPT * 3 * H * 2
    assert (chunked["draft"]["state_copies"], chunked["draft"]["state_copy_bytes"]) == (1, shift) == (1, 4_718_592)
    notes = [n for n in chunked["notes"] if n.startswith("state copies")]
    want = f"state copies: 1 x concatenate bf16[{b}, {PROMPT}, {3 * H}] eagle.py:"
    line = f"state copies: 2 x scatter bf16[{b}, 1, {BUCKET // 16}, 128] step.py:"  # K, then V, of the 2 layers
    assert len(notes) == 3 and notes[2].startswith(want) and all(n.startswith(line) for n in notes[:2]), notes
