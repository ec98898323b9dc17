"""The capacity planner against hand-computed per-rank byte counts (arithmetic written out below)."""

import pytest

from minimax_m3.config import M3Config
from minimax_m3.planner import (GIB, PlanError, attention_tile_bytes, decode_floor_ms, decode_minimum_bytes, main,
                                    plan, prefill_tile, prefill_flops, weight_bytes)

M3 = M3Config.preset("m3")


def test_m3_tp64_ep64_bf16_weights_by_hand():
    _, parts = weight_bytes(M3, 64, 64, "bf16")
    # 57 MoE layers x 2 local experts x (gate+up+down = 3 x 6144 x 3072) x 2 bytes
    assert parts["routed experts"] == 57 * 2 * 56_623_104 * 2 == 12_910_067_712
    # vocab 200064 = 3126 x 64; embedding and lm_head each 3126 x 6144 x 2 bytes
    assert parts["embedding + lm_head"] == 2 * 3126 * 6144 * 2 == 76_824_576
    # 60 layers x (q 128x6144 + o 6144x128 + k,v 1 head each = 4 x 786432, + q/k norm 256) x 2 bytes
    assert parts["attention"] == 60 * (4 * 786_432 + 256) * 2 == 377_518_080
    # 57 sparse layers x (index q, 1 head of 128 + index k 128, each x 6144 + norms 256) x 2 bytes
    assert parts["indexer"] == 57 * (2 * 786_432 + 256) * 2 == 179_335_680
    # 3 dense layers x 3 x 6144 x 12288 / 64 x 2 bytes
    assert parts["dense MLPs"] == 3 * 3 * 6144 * 192 * 2 == 21_233_664
    assert parts["shared experts"] == 57 * 3 * 6144 * 48 * 2 == 100_859_904
    # routers in fp32: 57 x (128 x 6144 + 128) x 4 bytes
    assert parts["routers (fp32)"] == 57 * (786_432 + 128) * 4 == 179_335_680
    assert parts["norms"] == 121 * 6144 * 2
    # the whole routed-expert set, 413.1 B params (docs/notes/perf_anchors.md §5.1), spread over 64 ranks
    assert parts["routed experts"] * 64 / 2 == pytest.approx(413.1e9, rel=1e-3)


def test_fp8_experts_by_hand():
    _, parts = weight_bytes(M3, 64, 64, "fp8")
    # NxD's expert-wise per-channel layout: 6,455,033,856 expert params per rank x 1 byte, plus fp32 scales
    # [E, 1, out]: 57 layers x 2 local experts x (gate/up 2 x 3072 + down 6144 channels) x 4 bytes
    assert parts["routed experts"] == 6_455_033_856 + 57 * 2 * 12_288 * 4 == 6_460_637_184
    bf16 = weight_bytes(M3, 64, 64, "bf16")[1]["routed experts"]
    assert parts["routed experts"] / bf16 == pytest.approx(0.5004, abs=1e-4)  # half of bf16's, plus 0.09 % scales


def test_decode_floor_fp8_by_hand():
    # the replicated layout (the port's sharded one: test_plan_layout.py), batch 32 at 4K on TP64/EP64: every step
    # reads both local experts (32 x 4 picks >= 2 local experts).
    # bf16 (planner): 17,835,174,912 bytes; fp8 replaces 12,910,067,712 expert bytes by 6,460,637,184
    bf16 = sum(decode_minimum_bytes(M3, 64, 64, 32, 4096, "bf16", layout="replicated").values())
    fp8 = sum(decode_minimum_bytes(M3, 64, 64, 32, 4096, "fp8", layout="replicated").values())
    assert bf16 == 17_835_174_912 and fp8 == bf16 - 12_910_067_712 + 6_460_637_184 == 11_385_744_384
    floor = decode_floor_ms(M3, 64, 64, 32, 4096, "fp8", layout="replicated")
    assert floor == pytest.approx(11_385_744_384 / 725e9 * 1e3) and floor <= 16.0  # issue 15's target: 15.70 ms


def test_caches_by_hand():
    p = plan(M3, 64, 64, batch=4, seq=4000, layout="replicated")  # rounded up to 4096 = 32 blocks of 128
    # one KV head per rank: 4 x 4096 tokens x 60 layers x (K+V) x 128 x 2 bytes = 30 KiB per token
    assert p.kv_bytes == 4 * 4096 * 60 * 2 * 128 * 2 == 4 * 4096 * 30_720
    # index-K on every rank: 57 sparse layers x 128 x 2 bytes = 14.25 KiB per token
    assert p.index_k_bytes == 4 * 4096 * 57 * 128 * 2 == 4 * 4096 * 14_592
    fp8 = plan(M3, 64, 64, batch=4, seq=4096, kv_dtype="fp8", layout="replicated")
    assert fp8.kv_bytes * 2 == p.kv_bytes and fp8.index_k_bytes * 2 == p.index_k_bytes


def test_prefill_working_memory_by_hand():
    p = plan(M3, 64, 64, batch=1, seq=2048, moe_block=512, layout="replicated")
    t = 2048
    hidden = 4 * t * 6144 * 2
    proj = t * (2 + 2) * 128 * 2 + t * 2 * 128 * 2
    # 8 chunks of 256 queries; 2048 tokens are 16 blocks <= top-16, so every chunk is dense causal: fp32 scores and
    # probabilities of the rank's one query head over 2048 keys, and the boolean mask
    assert p.chunk == 256
    attention = 256 * 2048 * 2 * 4 + 256 * 2048
    router = 2 * t * 128 * 4
    rows = (t * 4 // 512 + 2 - 1) * 512  # 17 blocks of 512 rows
    moe = router + rows * (2 * 6144 + 2 * 3072) * 2
    assert dict(p.phases) == {"attention tile": attention, "MoE": moe} and moe > attention
    logits = 3126 * 4
    assert p.prefill_bytes == hidden + proj + moe + logits == 426_782_936


def test_prefill_attention_chunk_at_32k_by_hand():
    # the port's chunk at 32K: 8 chunks of 4096 queries (the cap); 64K would take 16 chunks of 4096
    assert prefill_tile(M3, 32768) == 4096 and prefill_tile(M3, 65536) == 4096 and prefill_tile(M3, 8192) == 1024
    assert prefill_tile(M3, 6000) == 768 and prefill_tile(M3, 1000) == 128  # ceil(S / 8) in whole 128-token blocks
    a = attention_tile_bytes(M3, 64, 32768)
    # rank 0 of TP 64: 1 query head, 1 KV head, 1 index head; the last chunk's 4096 queries each gather 16 blocks
    # of 128 keys x 128 dims of K and of V (bf16), score them (fp32 scores + probabilities), and the indexer
    # scores the chunk against all 32768 keys (fp32), pools them to 256 blocks (fp32) and keeps 16 ids (int64)
    assert a == {
        "gathered K and V": 2 * 4096 * 16 * 128 * 128 * 2,  # 4 GiB
        "scores and probabilities": 4096 * 16 * 128 * 2 * 4,
        "index scores": 4096 * 32768 * 4,
        "pooled block scores": 4096 * 256 * 4,
        "selection": 4096 * 16 * 8,
    }
    assert sum(a.values()) == 4_903_665_664
    # the dense layers' chunk (4096 x 32768 fp32 scores + probabilities + mask) is smaller: the sparse one counts
    assert sum(a.values()) > 4096 * 32768 * 9
    p = plan(M3, 64, 64, batch=1, seq=32768, layout="replicated")
    moe = 2 * 32768 * 128 * 4 + (32768 * 4 // 512 + 1) * 512 * (2 * 6144 + 2 * 3072) * 2
    # at 32K the chunk (4.57 GiB) is just above the MoE buffers (4.55 GiB): it is the phase that counts
    assert dict(p.phases) == {"attention tile": 4_903_665_664, "MoE": moe} and moe < 4_903_665_664
    persistent = 4 * 32768 * 6144 * 2 + 32768 * 6 * 128 * 2 + 3126 * 4
    assert p.prefill_bytes == persistent + max(moe, 4_903_665_664)
    # a smaller cap is modelled as the port would run it: 1024-query chunks gather a quarter of the K/V
    assert attention_tile_bytes(M3, 64, 32768, chunk=1024)["gathered K and V"] == 2 ** 30
    assert plan(M3, 64, 64, batch=1, seq=32768, max_tile=1024, layout="replicated").chunk == 1024


def test_verdicts():
    assert plan(M3, 64, 64, batch=1, seq=4096, layout="replicated").fits
    # the published port's OOM at 8K x batch 8 (static batching: a prefill of 64K tokens at once) is reproduced ...
    assert not plan(M3, 64, 64, batch=8, seq=8192, ctx_batch=8, layout="replicated").fits
    # ... and prefilling one sequence at a time (the engine's continuous batching, the default) fits
    assert plan(M3, 64, 64, batch=8, seq=8192, ctx_batch=1, layout="replicated").fits
    assert plan(M3, 64, 64, batch=8, seq=8192, layout="replicated") == plan(M3, 64, 64, batch=8, seq=8192,
                                                                             ctx_batch=1, layout="replicated")
    # issue 14's long-context shapes with the port's tiles: 32K at batch 1 (4096-query tiles, 0.61 GiB headroom)
    # and 8K at batch 8 (continuous batching, 1024-query tiles)
    assert plan(M3, 64, 64, batch=1, seq=32768, layout="replicated").fits
    # 1 x 128K in bf16: ~5.6 GiB of caches on top of ~12.9 GiB of weights and the reserve
    big = plan(M3, 64, 64, batch=1, seq=131072, layout="replicated")
    assert big.kv_bytes + big.index_k_bytes == 131072 * (30_720 + 14_592)
    # BF16 weights on one trn2 at 32 x 128K cannot fit; the arithmetic says so
    assert not plan(M3, 64, 64, batch=32, seq=131072, weights="fp8", ctx_batch=1, layout="replicated").fits
    assert plan(M3, 64, 64, 1, 4096, layout="replicated").total_bytes == sum(
        getattr(plan(M3, 64, 64, 1, 4096, layout="replicated"), f) for f in
        ("weight_bytes", "kv_bytes", "index_k_bytes", "prefill_bytes", "reserve_bytes"))


def test_tp_smaller_than_kv_heads_and_bad_layouts():
    tiny = M3Config.preset("tiny")
    kv_heads = tiny.num_kv_heads
    p = plan(tiny, kv_heads, 1, batch=1, seq=tiny.index_block_size)
    assert p.kv_bytes == tiny.index_block_size * tiny.num_layers * 2 * 1 * tiny.head_dim * 2
    with pytest.raises(PlanError):
        plan(M3, 64, 48, 1, 128)  # ep must divide tp and the experts
    with pytest.raises(PlanError):
        plan(M3, 48, 16, 1, 128)  # 4 KV heads cannot be replicated evenly to 48 ranks


def test_cli_exit_codes(capsys):
    assert main(["--batch", "1", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "index-K cache" in out and "of 24.00 GiB" in out
    # today's port with static batching: 64K tokens prefilled at once
    assert main(["--layout", "replicated", "--batch", "8", "--seq", "8192", "--ctx-batch", "8"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--tp", "64", "--ep", "48", "--batch", "1", "--seq", "128"]) == 2
    assert GIB == 2 ** 30


# ---- the analytic minimum of `minimax-m3 graphs` ------------------------------------------------------------
TINY = M3Config.preset("tiny")  # h 128, 4 layers (1 dense + 3 sparse MoE), 8 q / 2 KV / 2 index heads, d 32


def test_decode_minimum_bytes_by_hand():
    got = decode_minimum_bytes(TINY, tp=2, ep=2, batch=1, bucket=64)
    # per rank at TP=2: 4 q heads, 1 KV head, 1 index head; vocab 512 -> 256 rows; 4 local experts, moe_tp 1
    embedding = (256 + 1) * 128 * 2  # the LM head shard + the one embedding row the token reads
    attention = 4 * (2 * 4 * 32 * 128 + 2 * 1 * 32 * 128 + 2 * 32) * 2
    indexer = 3 * (2 * 32 * 128 + 2 * 32) * 2
    norms = 9 * 128 * 2
    dense = 3 * 128 * 128 * 2
    shared = 3 * 3 * 128 * 32 * 2
    routers = 3 * (8 * 128 + 8) * 4
    experts = 3 * 4 * 3 * 128 * 64 * 2 * 2 // 4  # batch 1 x top-2 touches 2 of the 4 local experts
    assert got == {
        "weights": embedding + attention + indexer + norms + dense + shared + routers + experts,
        "kv_sparse": 1 * 32 * (1 * 32 * 2 * 2) * 3,  # top-2 blocks of 16 tokens, K and V, 3 sparse layers
        "index_k": 1 * 64 * 32 * 2 * 3,
        "kv_dense": 1 * 64 * (1 * 32 * 2 * 2) * 1,
    }
    f32 = decode_minimum_bytes(TINY, tp=2, ep=2, batch=1, bucket=64, dtype_bytes=4)
    assert f32["weights"] == 2 * (got["weights"] - routers) + routers and f32["index_k"] == 2 * got["index_k"]
    # a bucket shorter than top-k x block caps the selected blocks
    assert decode_minimum_bytes(TINY, 2, 2, 1, 16)["kv_sparse"] == 16 * 128 * 3


def test_prefill_flops_by_hand():
    got = prefill_flops(TINY, tp=2, ep=2, batch=1, seq=64)
    # keys per query: sparse layers min(i + 1, 32) summed over 64 queries = 528 + 32 * 32; dense 64 * 65 / 2
    keys = 3 * (528 + 1024) + 1 * 2080
    per_token = (4 * 2 * 128 * (2 * 4 + 2 * 1) * 32  # q, k, v, o projections of this rank
                 + 3 * 2 * 128 * (1 + 1) * 32  # index q (1 head) and index k, sparse layers
                 + 1 * 6 * 128 * 256 // 2 + 3 * (6 * 128 * 64 // 2 + 2 * 128 * 8))  # dense MLP, shared, router
    assert got == {
        "attention": 1 * 4 * 32 * 4 * keys,
        "indexer": 1 * 1 * 64 * 64 * 32 * 2 * 3,
        "routed_experts": 64 * 2 * 6 * 128 * 64 * 3 // 2,
        "rest": 64 * per_token + 2 * 128 * 256,
    }
