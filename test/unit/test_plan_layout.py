"""The planner's sharded layout (issue 23): caches split over a KV group, prompts prefilled in tiles, the
collectives, the TTFT estimate, the largest fit and the refusals, against hand computations written out below;
then issue 23's targets on M3's real config (TP 64 / EP 64 / LNC 2)."""

import pytest

from minimax_m3.config import M3Config
from minimax_m3.planner import (COLLECTIVE_LATENCY_S, GIB, LINK_BYTES_PER_S, PEAK_FLOPS_PER_S, PORT_LAYOUT,
                                ChunkError, FitError, PlanError, cache_bytes, chunk_bytes, chunk_choices, chunk_flops,
                                collectives, decode_floor_ms, decode_minimum_bytes, largest_batch, largest_context,
                                link_seconds, main, moe_bytes, plan, prefill_flops, prefill_persistent_bytes,
                                require_fit, sharded_attention_bytes, ttft, weight_bytes)
from minimax_m3.planner.fit import _largest

M3 = M3Config.preset("m3")
# tiny at TP 8 / EP 8: h 128, 4 layers (1 dense + 3 sparse MoE), 8 q heads (1 per rank), 2 KV heads -> G = 4 ranks per
# KV head (1 per rank), 1 index head per rank, d = di = 32, block 16 (4 keys per rank), top-2, vocab 512 (64 per
# rank), 8 experts top-2 (1 per rank), I 64, dense I 256, shared I 64
TINY = M3Config.preset("tiny")
TP = EP = 8


def test_sharded_caches_by_hand():
    # 100 tokens -> a 112-token bucket (7 blocks of 16); sharded, each rank of a group holds 112 / 4 = 28 of them
    kv, ik = cache_bytes(TINY, TP, batch=2, seq=100, layout="sharded")
    assert kv == 2 * 28 * 4 * 2 * 1 * 32 * 2  # batch x tokens x layers x (K, V) x 1 KV head x d x bf16
    assert ik == 2 * 28 * 3 * 32 * 2  # batch x tokens x sparse layers x di x bf16
    assert cache_bytes(TINY, TP, 2, 100, "replicated") == (4 * kv, 4 * ik)
    assert cache_bytes(TINY, TP, 2, 100, "sharded", "fp8") == (kv // 2, ik // 2)
    # no group to split over (TP 2 = 2 KV heads): both layouts store the same
    assert cache_bytes(TINY, 2, 1, 64, "sharded") == cache_bytes(TINY, 2, 1, 64, "replicated")
    # M3 at TP 64 (design note 1): 1.875 + 0.891 KiB per rank per token, vs 30 + 14.25 replicated
    assert cache_bytes(M3, 64, 1, 4096, "sharded") == (4096 * 1920, 4096 * 912)
    assert cache_bytes(M3, 64, 1, 4096, "replicated") == (4096 * 30_720, 4096 * 14_592)


def test_sharded_prefill_working_memory_by_hand():
    # the last 32-token call of a 112-token context: 7 blocks, 2 selected, 4 keys per block on this rank; one key tile
    # = min(112, top-2 x 16) / 4 = 8 keys; the rank's group has 4 query heads (qg), all-gathered
    got = sharded_attention_bytes(TINY, TP, seq=112, chunk=32)
    assert got == {
        "group queries": 32 * 4 * 32 * 2,  # C x qg x d, bf16
        "partial outputs and statistics": 32 * 4 * (32 + 2) * 4,  # fp32 output, max and sum
        "gathered K and V": 2 * 32 * 1 * 2 * 4 * 32 * 2,  # K and V: C x 1 KV head x 2 blocks x 4 keys x d, bf16
        "scores and probabilities": 32 * 4 * 2 * 4 * 2 * 4,  # fp32
        "index scores (one key tile)": 32 * 1 * 8 * 4,
        "partial block scores": 32 * 1 * 7 * 4,  # every block has keys on every rank
        "local top-k": 32 * 1 * 2 * (4 + 8),  # fp32 score + int64 id
        "gathered candidates": 32 * 1 * 4 * 2 * 2 * 4,  # 4 ranks' top-2, score and id as fp32
        "selection": 32 * 1 * 2 * 8,
    }
    assert sum(got.values()) == 71_808
    # a dense layer (online softmax over tiles of 8 keys per rank) alone: smaller, so above the sparse one counts
    dense = sharded_attention_bytes(TINY.replace(sparse_layers=(False,) * 4), TP, seq=112, chunk=32)
    assert dense == {
        "group queries": 32 * 4 * 32 * 2,
        "partial outputs and statistics": 32 * 4 * (32 + 2) * 4,
        "K and V tile": 2 * 1 * 8 * 32 * 2,  # bf16
        "scores and probabilities": 32 * 4 * 8 * 2 * 4,  # fp32
        "causal mask": 32 * 8,  # bool
    }
    assert sum(dense.values()) == 35_072 < 71_808
    assert prefill_persistent_bytes(TINY, TP, 32) == {
        "activations": 4 * 32 * 128 * 2,
        "projections": 32 * (2 + 2) * 32 * 2 + 32 * (1 + 1) * 32 * 2,  # q, k, v, out; index q, k
        "logits": 64 * 4,
    }
    # MoE for the call's 32 tokens: fp32 router logits and scores, and ceil(32 x 2 / 512) + 1 - 1 blocks of 512 rows
    # x (tokens in + out 2 x 128, gate/up 2 x 64) bf16
    moe = 2 * 32 * 8 * 4 + 1 * 512 * (2 * 128 + 2 * 64) * 2
    assert moe_bytes(TINY, TP, EP, 32) == moe == 395_264
    p = plan(TINY, TP, EP, batch=2, seq=100, layout="sharded", chunk=32)
    assert dict(p.phases) == {"attention": 71_808, "MoE": moe}
    assert p.prefill_bytes == 32768 + 12288 + 256 + moe
    assert (p.kv_bytes, p.index_k_bytes) == cache_bytes(TINY, TP, 2, 100, "sharded") and p.group == 4
    # the working memory is one call's at any context: only the partial block scores grow (one fp32 per block)
    far = sharded_attention_bytes(TINY, TP, seq=112 + 16 * 100, chunk=32)
    assert sum(far.values()) - sum(got.values()) == 32 * 100 * 4


def test_default_chunk_is_the_bucket_or_the_largest_power_of_two_that_fits():
    assert plan(TINY, TP, EP, 2, 100, layout="sharded").chunk == 112  # the bucket: one call per prompt
    assert chunk_choices(TINY, TP, 100) == [112, 64, 32, 16]  # then 16 x 2^j <= the bucket
    assert chunk_choices(M3, 64, 131200) == [8192, 4096, 2048, 1024, 512, 256, 128]  # bucket 131200 > the cap
    assert chunk_choices(M3, 64, 5000) == [5120, 4096, 2048, 1024, 512, 256, 128]
    assert plan(M3, 64, 64, 1, 1 << 20, layout="sharded").chunk == 8192  # the cap
    assert plan(M3, 64, 64, 1, 4096, layout="sharded").chunk == 4096  # the bucket
    # HBM for exactly the 4096-token call: 8192 no longer fits, so 4096 is chosen
    hbm = plan(M3, 64, 64, 1, 65536, layout="sharded", chunk=4096).total_bytes / GIB
    assert not plan(M3, 64, 64, 1, 65536, layout="sharded", chunk=8192, hbm_gib=hbm).fits
    assert plan(M3, 64, 64, 1, 65536, layout="sharded", hbm_gib=hbm).chunk == 4096


def test_chunk_refusals_name_the_sizes_that_work():
    with pytest.raises(ChunkError) as e:
        plan(M3, 64, 64, 1, 8192, layout="sharded", chunk=1000)
    assert "not a multiple of lcm(index block 128, KV group 16) = 128" in str(e.value)
    assert "nearest that work: 896 or 1024" in str(e.value)
    with pytest.raises(ChunkError) as e:
        plan(M3, 64, 64, 1, 8192, layout="sharded", chunk=16384)
    assert e.value.problems == ["prefill chunk 16384 is larger than the context bucket 8192: use at most 8192 "
                                "(e.g. 8192, 4096, 2048)"]
    with pytest.raises(ChunkError):
        plan(TINY, TP, EP, 1, 100, layout="sharded", chunk=24)  # lcm(16, 4) = 16
    with pytest.raises(PlanError):
        plan(M3, 64, 64, 1, 8192, layout="replicated", chunk=1024)  # today's port prefills in one call
    with pytest.raises(PlanError):
        plan(M3, 64, 64, 1, 8192, layout="sharded", ctx_batch=2)  # one request per call


def test_decode_minimum_bytes_sharded_by_hand():
    rep = decode_minimum_bytes(TINY, TP, EP, batch=1, bucket=64, layout="replicated")
    got = decode_minimum_bytes(TINY, TP, EP, batch=1, bucket=64, layout="sharded")
    per_key = 1 * 32 * 2 * 2  # 1 KV head x d x (K, V) x bf16
    assert got == {
        "weights": rep["weights"],
        "kv_sparse": 1 * (2 * 16 // 4) * per_key * 3,  # this rank's 4 keys of each of the 2 selected blocks
        "index_k": 1 * (64 // 4) * 32 * 2 * 3,
        "kv_dense": 1 * (64 // 4) * per_key * 1,
    }
    assert {k: rep[k] // 4 for k in ("kv_sparse", "index_k", "kv_dense")} == {k: got[k] for k in got if k != "weights"}
    # the library's default is the port's layout (neuron.config's kv_layout default)
    assert PORT_LAYOUT == "sharded" and got == decode_minimum_bytes(TINY, TP, EP, 1, 64)
    assert rep == decode_minimum_bytes(TINY, TP, EP, 1, 64, layout="replicated")


def test_a_verify_step_minimum_by_hand():
    """A speculative verify step, 2 rows x 3 tokens (k = 2) over a 64-token bucket: the weights once for the 6
    tokens, each row's dense K/V and index keys once for its 3 queries, each query its own selected blocks."""
    one = decode_minimum_bytes(TINY, TP, EP, batch=2, bucket=64)
    got = decode_minimum_bytes(TINY, TP, EP, batch=2, bucket=64, tokens=3)
    per_key = 1 * 32 * 2 * 2
    assert got == {
        "weights": one["weights"] + 4 * 128 * 2,  # 4 more embedding rows (6 tokens against 2)
        "kv_sparse": 2 * 3 * (2 * 16 // 4) * per_key * 3,  # each of the 6 queries: this rank's 4 keys of 2 blocks
        "index_k": 2 * (64 // 4) * 32 * 2 * 3,  # once per row, as a one-token step
        "kv_dense": 2 * (64 // 4) * per_key * 1,
    }
    assert {k: got[k] for k in ("index_k", "kv_dense")} == {k: one[k] for k in ("index_k", "kv_dense")}
    _, parts = weight_bytes(TINY, TP, EP)
    assert got["weights"] == sum(parts.values()) - parts["embedding + lm_head"] + (64 + 6) * 128 * 2  # LM head + rows


def test_chunk_flops_by_hand():
    # the call of tokens 32..63 of an 80-token prompt: causal keys of queries 32..63, sparse layers capped at 32
    got = chunk_flops(TINY, TP, EP, start=32, chunk=32, seq=80)
    sparse_keys = (528 + 32 * 32) - 528  # sum_{i<64} min(i+1, 32) - sum_{i<32} (i+1)
    dense_keys = 2080 - 528
    per_token = (4 * 2 * 128 * (2 + 2) * 32 + 3 * 2 * 128 * 2 * 32  # q, k, v, o; index q, k
                 + 6 * 128 * 256 // 8 + 3 * (6 * 128 * 64 // 8 + 2 * 128 * 8))  # dense MLP, shared, router
    assert got == {
        # 4 group heads against this rank's quarter of the keys = 1 head against all of them
        "attention": 4 * 32 * 4 * (3 * sparse_keys + dense_keys) // 4,
        "indexer": 1 * 32 * (64 // 4) * 32 * 2 * 3,  # 32 queries x the rank's 16 of the 64 keys
        "routed_experts": 32 * 2 * 6 * 128 * 64 * 3 // 8,
        "rest": 32 * per_token + 2 * 128 * 64,
    }
    # the calls of a prompt add up to today's one-call attention; the indexer does 1/G of a causal half
    calls = [chunk_flops(TINY, TP, EP, k, 32, 128) for k in range(0, 128, 32)]
    whole = prefill_flops(TINY, TP, EP, 1, 128)
    assert sum(f["attention"] for f in calls) == whole["attention"]
    assert sum(f["indexer"] for f in calls) == 32 * (32 + 64 + 96 + 128) // 4 * 32 * 2 * 3


def test_chunk_bytes_by_hand():
    got = chunk_bytes(TINY, TP, EP, start=32, chunk=32, seq=80, layout="sharded")
    _, parts = weight_bytes(TINY, TP, EP)
    assert got == {
        "weights": sum(parts.values()) - parts["embedding + lm_head"] + (64 + 32) * 128 * 2,  # LM head + 32 rows
        "index-K": (64 // 4) * 32 * 2 * 3,  # this rank's 16 of the keys < 64
        "gathered K/V": 32 * 2 * (16 // 4) * 2 * 32 * 2 * 3,  # once for the group's 4 heads
        "dense K/V": (64 // 4) * 2 * 32 * 2 * 1,
        # 4 [32, 128] copies per layer; MoE rows: 32 x top-2 x 1/8 local + one 512-row block, x (2 x 128 + 2 x 64)
        "activations": 4 * 32 * 128 * 2 * 4 + (8 + 512) * (2 * 128 + 2 * 64) * 2 * 3,
    }
    # the replicated layout: 8 query chunks of 16 (ops.tile_for); each rank gathers whole 16-key blocks for its own
    # head, top-2, except in the first two chunks (keys < 16 and < 32: at most 2 blocks), which ops.prefill attends
    # densely (the K/V of their keys, every layer); it scans the keys < t1 per query chunk
    rep = chunk_bytes(TINY, TP, EP, 0, 128, 128, layout="replicated")
    assert rep["gathered K/V"] == 16 * 6 * 2 * 16 * 2 * 32 * 2 * 3
    per_key = 2 * 32 * 2  # K and V, 1 KV head x d, bf16
    assert rep["dense K/V"] == (16 + 32) * per_key * 4 + sum(16 * t for t in range(3, 9)) * per_key * 1
    assert rep["index-K"] == sum(16 * t for t in range(1, 9)) * 32 * 2 * 3


def test_collectives_by_hand():
    rows = collectives(TINY, TP, EP, tokens=3)
    assert [(r["name"], r["kind"], r["ranks"], r["dtype"], r["bytes"], r["count"]) for r in rows] == [
        ("embedding", "all-gather", 8, "bf16", 3 * 128 * 2, 1),  # NxD's embedding is sharded along hidden
        ("group queries", "all-gather", 4, "bf16", 3 * 4 * 32 * 2, 1),  # the dense layer
        # decode, sparse layers: the 4 query heads (fp32) and 4 ranks x top-2 (score, id) in one all-gather
        ("group queries + selection candidates", "all-gather", 4, "fp32", 3 * (4 * 32 + 4 * 1 * 2 * 2) * 4, 3),
        ("partial outputs + max + sum", "all-to-all", 4, "fp32", 3 * 4 * (32 + 2) * 4, 4),
        ("attention output", "all-reduce", 8, "bf16", 3 * 128 * 2, 4),
        ("MLP / MoE output", "all-reduce", 8, "bf16", 3 * 128 * 2, 4),
        ("LM head logits", "all-gather", 8, "bf16", 3 * 512 * 2, 1),  # gathered before the fp32 cast
    ]
    pre = collectives(TINY, TP, EP, 32, phase="prefill")  # a prefill call gathers queries and candidates apart
    assert [(r["name"], r["dtype"], r["bytes"], r["count"]) for r in pre[1:4]] == [
        ("group queries", "bf16", 32 * 4 * 32 * 2, 4), ("selection candidates", "fp32", 32 * 1 * 4 * 2 * 2 * 4, 3),
        ("partial outputs + max + sum", "fp32", 32 * 4 * 34 * 4, 4)]
    assert [r["name"] for r in collectives(TINY, TP, EP, 3, "replicated")] == [
        "embedding", "attention output", "MLP / MoE output", "LM head logits"]
    assert collectives(TINY, TP, EP, 32, logit_rows=1)[-1]["bytes"] == 512 * 2
    # ring: an all-reduce sends 2 x 7/8 of its buffer, an all-gather 7/8 of its output
    assert link_seconds(rows[5]) == pytest.approx(768 * 7 / 8 * 2 / LINK_BYTES_PER_S)
    assert link_seconds(rows[1]) == pytest.approx(768 * 3 / 4 / LINK_BYTES_PER_S)


def test_verify_collectives_by_hand():
    """A verify step of 2 rows x 3 tokens: a decode step's collectives at 6 tokens (query heads and candidates in
    ONE all-gather, fewer than ONE_GATHER_TOKENS per row), every token's logits; 16 tokens per row gather them apart,
    as a prefill call does."""
    from minimax_m3.ops.step import ONE_GATHER_TOKENS

    assert collectives(TINY, TP, EP, 6, row_tokens=3) == collectives(TINY, TP, EP, 6)
    assert collectives(TINY, TP, EP, 6, row_tokens=3)[-1]["bytes"] == 6 * 512 * 2
    wide = collectives(TINY, TP, EP, 2 * 16, row_tokens=ONE_GATHER_TOKENS)
    assert ONE_GATHER_TOKENS == 16 and [(r["name"], r["dtype"], r["bytes"], r["count"]) for r in wide[1:4]] == [
        ("group queries", "bf16", 32 * 4 * 32 * 2, 4), ("selection candidates", "fp32", 32 * 1 * 4 * 2 * 2 * 4, 3),
        ("partial outputs + max + sum", "fp32", 32 * 4 * 34 * 4, 4)]


def test_ttft_adds_up_the_calls():
    t = ttft(TINY, TP, EP, seq=80, layout="sharded", chunk=32)
    calls = [(0, 32), (32, 32), (64, 32)]  # the last call runs 32 rows for the prompt's last 16 tokens
    flop = [sum(chunk_flops(TINY, TP, EP, k, n, 80).values()) / PEAK_FLOPS_PER_S for k, n in calls]
    hbm = [sum(chunk_bytes(TINY, TP, EP, k, n, 80).values()) / 725e9 for k, n in calls]
    link = sum(link_seconds(r) * r["count"] for r in collectives(TINY, TP, EP, 32, logit_rows=1, phase="prefill"))
    assert (t.calls, t.chunk, t.collectives) == (3, 32, 3 * 21)  # 1 + 4 + 3 + 4 + 4 + 4 + 1 per call
    assert t.flop_s == pytest.approx(sum(flop)) and t.hbm_s == pytest.approx(sum(hbm))
    assert t.bound_s == pytest.approx(sum(max(f, b, link) for f, b in zip(flop, hbm)))
    assert t.total_s == pytest.approx(t.bound_s + 63 * COLLECTIVE_LATENCY_S)
    one = ttft(TINY, TP, EP, seq=80, layout="replicated")
    assert (one.calls, one.chunk, one.collectives) == (1, 80, 10)


def test_largest_fit_bisection():
    assert _largest(lambda n: n <= 1000, 16, 16, 1 << 20) == 992
    assert _largest(lambda n: n <= 1000, 16, 16, 512) == 512  # the limit
    assert _largest(lambda n: False, 16, 16, 1 << 20) == 0
    for layout in ("replicated", "sharded"):
        n = largest_context(M3, 64, 64, 1, layout=layout)
        assert plan(M3, 64, 64, 1, n, layout=layout).fits and not plan(M3, 64, 64, 1, n + 128, layout=layout).fits
        b = largest_batch(M3, 64, 64, 32768, layout=layout)
        assert plan(M3, 64, 64, b, 32768, layout=layout).fits
        assert not plan(M3, 64, 64, b + 1, 32768, layout=layout).fits
    assert largest_context(M3, 64, 64, 1, layout="replicated") == 35_456  # docs/long_context.md, today's port
    assert largest_batch(M3, 64, 64, 32768, layout="replicated") == 1
    assert largest_batch(M3, 64, 64, 131072, layout="replicated") == 0


def test_require_fit_names_the_largest_that_fit():
    assert require_fit(M3, 64, 64, 1, 131072, layout="sharded") == plan(M3, 64, 64, 1, 131072, layout="sharded")
    with pytest.raises(FitError) as e:
        require_fit(M3, 64, 64, 8, 1 << 20, layout="sharded")
    ctx, bat = largest_context(M3, 64, 64, 8, layout="sharded"), largest_batch(M3, 64, 64, 1 << 20, layout="sharded")
    assert (e.value.largest_context, e.value.largest_batch) == (ctx, bat) and 0 < ctx < 1 << 20 and bat >= 1
    assert f"largest context at batch 8: {ctx} tokens" in str(e.value)
    assert f"largest batch at 1048576 tokens: {bat}" in str(e.value)
    with pytest.raises(FitError) as e:
        require_fit(M3, 64, 64, 1, 131072, layout="replicated")
    assert e.value.largest_batch == 0 and "not even batch 1 fits at 131072 tokens" in str(e.value)
    with pytest.raises(ChunkError):  # before any fit
        require_fit(M3, 64, 64, 64, 1 << 20, layout="sharded", chunk=1000)


def test_require_fit_names_the_largest_under_each_decode_experts_choice():
    """Issue 34's bad input: a decode copy of the bf16 experts fits no context at all (the weights alone are over
    24 GiB); the refusal says so and that the choice without the copy fits, before any compile. fp8 at batch 8 x 1M
    fits neither way: the other choice's largest context and batch are named too."""
    with pytest.raises(FitError) as e:
        require_fit(M3, 64, 64, 1, 1 << 20, layout="sharded", decode_experts="tp")
    msg = str(e.value)
    assert e.value.largest_context == 0 and "no context fits at batch 1" in msg
    assert "a decode copy of the experts (--decode-experts tp)" in msg
    assert "with --decode-experts ep: it fits" in msg  # bf16 1M without the copy: 20.20 GiB
    with pytest.raises(FitError) as e:
        require_fit(M3, 64, 64, 8, 1 << 20, layout="sharded", weights="fp8")
    ctx = largest_context(M3, 64, 64, 8, layout="sharded", weights="fp8", decode_experts="tp")
    bat = largest_batch(M3, 64, 64, 1 << 20, layout="sharded", weights="fp8", decode_experts="tp")
    assert 0 < ctx < e.value.largest_context and 0 < bat < e.value.largest_batch
    assert f"with --decode-experts tp: largest context at batch 8 {ctx} tokens, largest batch at 1048576 tokens " \
           f"{bat}" in str(e.value)
    with pytest.raises(PlanError, match="the NxDI port's"):
        plan(M3, 64, 64, 1, 8192, layout="paged", decode_experts="tp")


def test_require_fit_names_the_largest_under_the_other_kv_layout():
    """``--kv-layout replicated`` at 128K (fp8, the decode copy) does not fit; the refusal names the replicated
    layout's largest context and that the sharded one fits; a sharded 1M at batch 8 names the replicated one's."""
    kw = dict(weights="fp8", decode_experts="tp")
    with pytest.raises(FitError) as e:
        require_fit(M3, 64, 64, 1, 131072, layout="replicated", **kw)
    ctx = largest_context(M3, 64, 64, 1, layout="replicated", **kw)
    assert e.value.largest_context == ctx and 4096 < ctx < 131072
    assert "with --kv-layout sharded: it fits" in str(e.value)
    with pytest.raises(FitError) as e:
        require_fit(M3, 64, 64, 8, 1 << 20, layout="sharded", **kw)
    ctx = largest_context(M3, 64, 64, 8, layout="replicated", **kw)
    bat = largest_batch(M3, 64, 64, 1 << 20, layout="replicated", **kw)
    assert bat == 0 and f"with --kv-layout replicated: largest context at batch 8 {ctx} tokens, largest batch at " \
                        "1048576 tokens 0" in str(e.value)


def test_cli_prints_both_layouts(capsys):
    assert main(["--batch", "1", "--seq", "1048576", "--weights", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "sharded caches" in out and "selection candidates" in out and "TTFT estimate" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("4K |", "32K |", "128K |", "512K |", "1M |"))]
    assert len(rows) == 5 and rows[-1].split("|")[1].split()[1] == "no" and rows[-1].split("|")[2].split()[2] == "yes"
    assert "largest context at batch 1: replicated 61,824 tokens; sharded " in out
    assert main(["--batch", "1", "--seq", "8192", "--chunk", "1000"]) == 2
    assert "nearest that work: 896 or 1024" in capsys.readouterr().out


# ---- issue 23's targets, M3 at TP 64 / EP 64 / LNC 2 (24 GiB per logical core) ---------------------------------------
def test_issue23_targets():
    def fits(batch, seq, weights):
        return plan(M3, 64, 64, batch, seq, weights, layout="sharded").fits

    assert fits(1, 1_048_576, "fp8")
    assert largest_context(M3, 64, 64, 1, layout="sharded") >= 524_288  # bf16 experts (1M fits too: 20.20 GiB)
    assert fits(8, 131_072, "bf16")
    assert fits(16, 32_768, "bf16") and fits(32, 32_768, "fp8")
    assert decode_floor_ms(M3, 64, 64, 32, 4096, "bf16", layout="sharded") <= 20.0  # 19.39 ms (replicated 24.60)
    assert decode_floor_ms(M3, 64, 64, 32, 4096, "fp8", layout="sharded") <= 11.0  # 10.50 ms (replicated 15.70)


def test_prefill_gathers_once_per_group():
    # per sparse layer at 32K: today each rank gathers 1 MiB per query for its own head; sharded, (C / 16) x 1 MiB
    # per call for the 16 heads of its group (the issue's >= 10x less)
    rep = chunk_bytes(M3, 64, 64, 0, 32768, 32768, layout="replicated")["gathered K/V"]
    shd = sum(chunk_bytes(M3, 64, 64, k, 8192, 32768)["gathered K/V"] for k in range(0, 32768, 8192))
    assert rep == 32768 * 2 ** 20 * 57 and shd * 16 == rep
