"""Issue 32, "Long context": ``minimax-m3 plan --layout paged``, the vLLM Neuron model's memory on a trn2.48xlarge
(TP 64, LNC 2: 64 logical cores of 24 GiB), graded against hand computations from M3's widths written out below.

The layout (``minimax_m3.vllm_neuron``): per layer K/V pages of the rank's KV head (4 KV heads at TP 64: each on the
16 ranks of its group, one per rank), per sparse layer the index keys as two halves in an index spec's K and V pages;
pages of 128 tokens shared by the running requests; a prompt prefilled one request per forward in segments of
``max_num_batched_tokens`` tokens (512..8192), so the working memory is one segment's; experts over ``ep_degree``
groups (1: tensor-parallel, 64: 2 whole experts per rank); bf16 weights and pages only."""

import re

import pytest

from minimax_m3.config import M3Config
from minimax_m3.planner import (GIB, LAYOUTS, PAGED, PAGED_SEGMENTS, PAGED_SINGLE_SHOT, PAGED_TILE, ChunkError,
                                FitError, PlanError, cache_bytes, collectives, decode_minimum_bytes, largest_batch,
                                largest_context, main, plan, require_fit, ttft)
from minimax_m3.planner.cost import decode_itl

M3 = M3Config.preset("m3")
H, D, DI, L, SPARSE, DENSE, MOE = 6144, 128, 128, 60, 57, 3, 57
VOCAB_RANK = 200064 // 64  # 3,126 rows per rank: the model splits the vocabulary evenly
HBM, LINK, RESERVE, RANK = 725e9, 256e9, 3 * GIB, 24 * GIB

# ---- hand computations -----------------------------------------------------------------------------------------------
# pages per token and rank: K and V of 1 KV head x 128 x bf16 in 60 layers; the index key's two halves of 64 x bf16
# in 57 sparse layers
KV_PER_TOKEN = 60 * 2 * 1 * 128 * 2  # 30,720
INDEX_PER_TOKEN = 57 * 2 * 1 * 64 * 2  # 14,592
PAGE_BYTES_PER_TOKEN = KV_PER_TOKEN + INDEX_PER_TOKEN  # 45,312


def hand_weights(ep: int) -> int:
    """Per rank at TP 64: the vocabulary's 3,126 rows of embedding and LM head; per layer q and o (1 query head x 128
    x 6144 each), k and v (the rank's KV head), q/k norms (128 each); per sparse layer the indexer's q (1 index head)
    and k (its single head) and 2 norms; 121 RMSNorms; the 3 dense MLPs' and 57 shared experts' 1/64; the fp32
    routers (128 x 6144 + bias); routed experts: ep 64, 2 whole experts (gate, up, down of 6144 x 3072); ep 1,
    all 128 experts' 1/64 slices (3072 / 64 = 48 columns) -- the same bytes."""
    experts = {64: MOE * 2 * 3 * H * 3072 * 2, 1: MOE * 128 * 3 * H * 48 * 2}[ep]
    return (2 * VOCAB_RANK * H * 2 + L * (4 * D * H + 2 * D) * 2 + SPARSE * (2 * DI * H + 2 * DI) * 2 + 121 * H * 2
            + DENSE * 3 * H * 192 * 2 + MOE * 3 * H * 48 * 2 + MOE * (128 * H + 128) * 4 + experts)


def hand_segment_parts(ep: int, seq: int, seg: int = 8192) -> tuple[int, int, int]:
    """One prefill segment of ``seg`` tokens at the end of a ``seq``-token context (seq a multiple of 128 with more
    than 16 blocks), ``(kept, attention, moe)``: kept through a layer, 4 [seg, 6144] activations, the rank's q, k, v,
    o (4 x 128) and index q, k (2 x 128) projections, one row of fp32 logits; then one of the two phases:
    * the attention of one tile, the larger of a sparse layer's (256 queries: K and V of 16 selected blocks of 128
      keys per query (bf16), fp32 scores and probabilities of them, the indexer's fp32 scores of every key, pooled
      fp32 block scores, an int64 selection of 16) and a dense layer's (fp32 scores and probabilities and a bool
      mask of every key, for min(256, 2^24 / seq) queries: ops.step keeps a dense tile's scores within 2^24), plus
      the larger of the row's lines laid end to end: a dense layer's K and V (2 x seq x 1 x 128 x bf16), not a
      sparse layer's index keys (their two halves, read apart: seq x 128 x bf16);
    * the MoE as the model's static formulation computes it: fp32 router logits and scores (128 experts), then for
      seg x 4 rows over the rank's local experts (2 at ep 64 with I = 3072; 128 at ep 1 with I = 48) either every
      local expert on every token (gate/up 2I, activation I, out 6144 per token and expert, bf16) or blocks of b rows
      (b the largest power of two in 8..128 with 2b <= rows / (4 x local); ceil(rows / b) + local blocks): the
      placed rows plus a spare (6144), each block's gathered expert weights (3 x 6144 x I), gate/up, activation and
      out per placed row (3I + 6144), bf16, and the rows read back in fp32 and bf16 (6144 x 6 bytes each) --
      whichever computes fewer rows (ep 64: every expert; ep 1: blocks)."""
    t = min(PAGED_TILE, seg)
    kept = 4 * seg * H * 2 + seg * (4 * D + 2 * DI) * 2 + VOCAB_RANK * 4
    sparse = 2 * t * 16 * 128 * D * 2 + t * 16 * 128 * 2 * 4 + t * seq * 4 + t * (seq // 128) * 4 + t * 16 * 8
    td = min(t, (1 << 24) // seq)
    attention = max(sparse, td * seq * 2 * 4 + td * seq) + 2 * seq * DI * 2
    local, i = {64: (2, 3072), 1: (128, 48)}[ep]
    rows, b = seg * 4, 8
    while b < 128 and 2 * b <= rows // (4 * local):
        b *= 2
    n = -(-rows // b) + local
    if seg * local <= n * b:
        work = local * seg * (3 * i + H) * 2
    else:
        work = ((n * b + 1) * H + n * 3 * H * i + n * b * (3 * i + H)) * 2 + rows * H * 6
    moe = 2 * seg * 128 * 4 + work
    return kept, attention, moe


def hand_segment(ep: int, seq: int, seg: int = 8192) -> int:
    kept, attention, moe = hand_segment_parts(ep, seq, seg)
    return kept + max(attention, moe)


def hand_largest_context(ep: int, seg: int = 8192) -> int:
    """Whole pages left after weights, reserve and one segment: the largest S (a multiple of 128) with both
    ``base + attention(S) + S x 45,312`` and ``base + moe + S x 45,312`` within the rank, where at these contexts
    (dense tiles under 2^24 x 9 bytes, below the sparse tile's fixed 272 MB) attention(S) = the sparse tile's
    272,662,528 bytes of gathered K/V, scores and selection + S x (256 x 4 index scores + 256 x 4 / 128 pooled +
    512 of a dense layer's K and V line)."""
    kept, _, moe = hand_segment_parts(ep, 131072, seg)
    t = min(PAGED_TILE, seg)
    fixed = 2 * t * 16 * 128 * D * 2 + t * 16 * 128 * 2 * 4 + t * 16 * 8
    room = RANK - hand_weights(ep) - RESERVE - kept
    by_attention = (room - fixed) // (PAGE_BYTES_PER_TOKEN + t * 4 + t * 4 // 128 + 2 * DI * 2)
    by_moe = (room - moe) // PAGE_BYTES_PER_TOKEN
    return min(by_attention, by_moe) // 128 * 128


def test_the_layout_is_listed_and_named():
    assert PAGED == "paged" and LAYOUTS == ("replicated", "sharded", "paged")


def test_pages_by_hand():
    assert cache_bytes(M3, 64, 1, 128, PAGED) == (128 * KV_PER_TOKEN, 128 * INDEX_PER_TOKEN)
    # each request rounded up to whole pages: 3 requests of 1,000 tokens hold 8 pages (1,024 tokens) each
    kv, ik = cache_bytes(M3, 64, 3, 1000, PAGED)
    assert kv + ik == 3 * 1024 * PAGE_BYTES_PER_TOKEN
    # the same bytes per token as NxDI's GQA copies (each KV head on its 16 ranks, the index keys on all 64)
    assert cache_bytes(M3, 64, 3, 1000, PAGED) == cache_bytes(M3, 64, 3, 1000, "replicated")
    p = plan(M3, 64, 64, 8, 131072, layout=PAGED)
    assert (p.kv_bytes, p.index_k_bytes) == (8 * 131072 * KV_PER_TOKEN, 8 * 131072 * INDEX_PER_TOKEN)


@pytest.mark.parametrize("ep", [1, 64])
def test_weights_by_hand(ep):
    p = plan(M3, 64, ep, 1, 131072, layout=PAGED)
    assert p.weight_bytes == hand_weights(ep)
    assert f"{p.weight_bytes / GIB:.2f}" == "12.90"
    assert p.reserve_bytes == RESERVE and p.hbm_bytes == RANK


@pytest.mark.parametrize("ep", [1, 64])
@pytest.mark.parametrize("seq", [32768, 131072, 1 << 20])
def test_one_segments_working_memory_by_hand(ep, seq):
    p = plan(M3, 64, ep, 1, seq, layout=PAGED)
    assert p.chunk == 8192 and p.prefill_bytes == hand_segment(ep, seq)
    _, attention, moe = hand_segment_parts(ep, seq)
    assert dict(p.phases) == {"attention tile": attention, "MoE": moe}
    # a smaller segment, less working memory (its tile: 256 queries, or the whole segment)
    assert plan(M3, 64, ep, 1, seq, layout=PAGED, chunk=2048).prefill_bytes == hand_segment(ep, seq, 2048)
    # the replicated layout prefills the whole prompt in one call: its working memory grows with the prompt
    if seq > 8192:
        assert plan(M3, 64, ep, 1, seq, layout="replicated").prefill_bytes > p.prefill_bytes


def test_figures_at_128k():
    """What docs/vllm_neuron_model.md quotes: at batch 1 / 128K the bf16 model fits at ep 64 (MoE 0.48 GiB: every
    token through both local experts) and misses at ep 1 (blocks over 128 local experts, each block's expert weights
    copied: 3.14 GiB); batch 8 needs 44.25 GiB of pages."""
    ep64, ep1 = plan(M3, 64, 64, 1, 131072, layout=PAGED), plan(M3, 64, 1, 1, 131072, layout=PAGED)
    assert ep64.fits and not ep1.fits
    assert [f"{x.total_bytes / GIB:.2f}" for x in (ep64, ep1)] == ["22.29", "24.95"]
    assert not plan(M3, 64, 64, 8, 131072, layout=PAGED).fits
    assert largest_batch(M3, 64, 64, 131072, layout=PAGED) == 1 and largest_batch(M3, 64, 1, 131072,
                                                                                  layout=PAGED) == 0


@pytest.mark.parametrize("ep", [1, 64])
def test_largest_context_by_hand(ep):
    n = largest_context(M3, 64, ep, 1, layout=PAGED)
    assert n == hand_largest_context(ep) == {64: 171_008, 1: 108_544}[ep]
    assert plan(M3, 64, ep, 1, n, layout=PAGED).fits and not plan(M3, 64, ep, 1, n + 128, layout=PAGED).fits
    # the pages are one pool: 8 requests fit about an eighth each
    assert largest_context(M3, 64, ep, 8, layout=PAGED) * 8 <= n
    # a 2,048-token segment leaves more for pages
    assert largest_context(M3, 64, ep, 1, layout=PAGED, chunk=2048) == hand_largest_context(ep, 2048) > n


def test_the_docs_192k_reconciled():
    """docs/vllm_neuron_model.md had "about 192,000 tokens": (24 - 12.90 - 3) GiB / 45,312 bytes, before the
    segment's working memory; with it the planner's figure is 171,008 (ep 64) and the doc says so."""
    assert (RANK - hand_weights(64) - RESERVE) // PAGE_BYTES_PER_TOKEN // 1000 == 192
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "vllm_neuron_model.md").read_text()
    assert "171,008" in doc and "108,544" in doc and "minimax-m3 plan --tp 64 --ep 64 --batch 1 --seq 131072 " \
        "--layout paged" in doc


def test_collectives_and_decode_itl_by_hand():
    """The reference's layers (the vLLM Neuron model's): per layer the attention and MLP all-reduces, the
    vocabulary-parallel embedding's all-reduce, the logits gathered in fp32 for the sampled rows; 122 at TP 64."""
    rows = collectives(M3, 64, 64, 8, PAGED)
    got = [(r["name"], r["kind"], r["ranks"], r["dtype"], r["bytes"], r["count"]) for r in rows]
    assert got == [("embedding", "all-reduce", 64, "bf16", 8 * H * 2, 1),
                   ("attention output", "all-reduce", 64, "bf16", 8 * H * 2, 60),
                   ("MLP / MoE output", "all-reduce", 64, "bf16", 8 * H * 2, 60),
                   ("LM head logits", "all-gather", 64, "fp32", 8 * 200064 * 4, 1)]
    for ep, batch, seq in ((64, 1, 131072), (64, 8, 131072), (1, 1, 131072), (64, 32, 4096)):
        local = {64: 2, 1: 128}[ep]
        experts = MOE * local * 3 * H * {64: 3072, 1: 48}[ep] * 2
        read = (hand_weights(ep) - 2 * VOCAB_RANK * H * 2 + (VOCAB_RANK + batch) * H * 2
                - experts + experts * min(local, batch * 4) // local
                + batch * 16 * 128 * 512 * SPARSE + batch * seq * DI * 2 * SPARSE + batch * seq * 512 * DENSE)
        t = batch
        coll = (121 * max(25e-6, t * H * 2 * 2 * 63 / 64 / LINK)
                + max(25e-6, t * 200064 * 4 * 63 / 64 / LINK))
        itl = decode_itl(M3, 64, ep, batch, seq, layout=PAGED)
        assert itl.bytes == read and itl.collectives == 122
        assert itl.total_s == pytest.approx(read / HBM + coll, rel=1e-12)


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def _gib(out: str, label: str) -> float:
    return float(re.search(rf"^  {label}\s+([\d.]+) GiB", out, re.M).group(1))


@pytest.mark.parametrize("ep", [1, 64])
@pytest.mark.parametrize("batch", [1, 8])
def test_cli_prints_the_layouts_plan(capsys, ep, batch):
    rc, out = _run(capsys, "--tp", "64", "--ep", str(ep), "--batch", str(batch), "--seq", "131072", "--layout",
                   "paged")
    p = plan(M3, 64, ep, batch, 131072, layout=PAGED)
    assert rc == (0 if p.fits else 1)
    assert (f"MiniMax-M3 on tp=64 ep={ep} (moe_tp={64 // ep}), batch={batch}, seq=131072, prefill batch=1, weights "
            "bf16, KV bf16, paged caches (vLLM Neuron); per rank:") in out
    assert _gib(out, "weights") == round(hand_weights(ep) / GIB, 2)
    assert _gib(out, "KV cache") == round(batch * 131072 * KV_PER_TOKEN / GIB, 2)
    assert _gib(out, "index-K cache") == round(batch * 131072 * INDEX_PER_TOKEN / GIB, 2)
    assert _gib(out, "prefill working mem") == round(hand_segment(ep, 131072) / GIB, 2)
    assert "(activations of one 8192-token segment + the larger of:)" in out
    assert "attention tile (256 queries + a row's key line)" in out
    total = hand_weights(ep) + batch * 131072 * PAGE_BYTES_PER_TOKEN + hand_segment(ep, 131072) + RESERVE
    assert _gib(out, "total") == round(total / GIB, 2)
    verdict = "FITS: headroom" if total <= RANK else "DOES NOT FIT: short by"
    assert f"{verdict} {abs(RANK - total) / GIB:.2f} GiB" in out
    assert "45,312 bytes per token per rank" in out and f"{batch} x 131,072 = {batch * 131072:,} tokens" in out
    # the decode ITL estimate (plain) is this layout's; the fused step and TTFT say they are not covered
    itl = decode_itl(M3, 64, ep, batch, 131072, layout=PAGED)
    assert (f"decode ITL estimate at batch {batch}, 131072 tokens: {itl.total_s * 1e3:.2f} ms per step" in out
            and "122 collectives" in out)
    assert "decode ITL estimate, fused EAGLE3 step: not covered for the paged layout" in out
    assert "TTFT estimate: not covered for the paged layout" in out
    # the largest context at the batch and the largest batch at the context, beside the port's layouts
    ctx = largest_context(M3, 64, ep, batch, layout=PAGED)
    assert re.search(rf"^largest context at batch {batch}: replicated [\d,]+ tokens; sharded [\d,]+ tokens; paged "
                     rf"{ctx:,} tokens", out, re.M)
    assert re.search(rf"^largest batch at 131,072 tokens: replicated 0; sharded \d+; paged "
                     rf"{largest_batch(M3, 64, ep, 131072, layout=PAGED)}$", out, re.M)
    # and the side-by-side table has the paged column
    row = next(line for line in out.splitlines() if line.strip().startswith("128K |"))
    seg, gib, fits, _ = row.split("|")[3].split()
    assert (int(seg), float(gib), fits) == (8192, round(total / GIB, 2), "yes" if total <= RANK else "no")


def test_cli_largest_context_at_batch_1(capsys):
    _, out = _run(capsys, "--tp", "64", "--ep", "64", "--batch", "1", "--seq", "171008", "--layout", "paged")
    assert "FITS" in out and "paged 171,008 tokens" in out
    rc, out = _run(capsys, "--tp", "64", "--ep", "64", "--batch", "1", "--seq", "171136", "--layout", "paged")
    assert rc == 1 and "DOES NOT FIT" in out


def test_segments():
    # default: the largest segment, or the whole prompt when it is shorter (one call)
    assert plan(M3, 64, 64, 1, 4000, layout=PAGED).chunk == 4000
    for s in PAGED_SEGMENTS:
        assert plan(M3, 64, 64, 1, 131072, layout=PAGED, chunk=s).chunk == s
    # a segment longer than the context: the plugin compiles that bucket all the same
    longer = plan(M3, 64, 64, 1, 4096, layout=PAGED, chunk=8192)
    assert longer.chunk == 8192 and longer.prefill_bytes > plan(M3, 64, 64, 1, 4096, layout=PAGED).prefill_bytes
    # single-shot: a whole prompt of at most 16K in one call
    assert plan(M3, 64, 64, 1, 12288, layout=PAGED, chunk=12288).chunk == 12288 == min(12288, PAGED_SINGLE_SHOT)


def test_bad_input(capsys):
    with pytest.raises(ChunkError, match=r"prefill segment \(--chunk\) 3000: .* one of 512, 1024, 2048, 4096, 8192"):
        plan(M3, 64, 64, 1, 131072, layout=PAGED, chunk=3000)
    with pytest.raises(ChunkError, match="at most 16384 tokens in one call"):
        plan(M3, 64, 64, 1, 32768, layout=PAGED, chunk=32768)
    with pytest.raises(PlanError, match="--decode-experts tp is the NxDI port's"):
        plan(M3, 64, 64, 1, 4096, "fp8", layout=PAGED, decode_experts="tp")
    with pytest.raises(PlanError, match="--kv-dtype fp8: .* --kv-cache-dtype auto"):
        plan(M3, 64, 64, 1, 4096, kv_dtype="fp8", layout=PAGED)
    with pytest.raises(PlanError, match="--ctx-batch 2: vLLM Neuron prefills one request per forward"):
        plan(M3, 64, 64, 1, 4096, ctx_batch=2, layout=PAGED)
    with pytest.raises(PlanError, match="ep 3 .*the vLLM Neuron model's tp 64 / ep_degree 3"):
        plan(M3, 64, 3, 1, 4096, layout=PAGED)
    with pytest.raises(PlanError, match="not modelled for the paged layout"):
        ttft(M3, 64, 64, 4096, PAGED, 4096)
    with pytest.raises(FitError, match=r"paged caches, prefill segments of 8192 tokens"):
        require_fit(M3, 64, 64, 8, 131072, layout=PAGED)
    # the CLI: one error naming the option, exit 2
    for argv, said in ((["--chunk", "3000"], "minimax-m3 plan: prefill segment (--chunk) 3000: the paged layout"),
                       (["--decode-experts", "tp"], "minimax-m3 plan: --decode-experts tp is the NxDI port's"),
                       (["--kv-dtype", "fp8"], "minimax-m3 plan: --kv-dtype fp8: the vLLM Neuron model")):
        rc, out = _run(capsys, "--batch", "1", "--seq", "131072", "--layout", "paged", *argv)
        assert rc == 2 and out.startswith(said) and out.count("\n") == 1
    # the port's layouts with an fp8 KV cache: the paged columns say why they are empty
    rc, out = _run(capsys, "--batch", "1", "--seq", "131072", "--kv-dtype", "fp8")
    assert rc == 0 and "paged bf16 pages only" in out and out.count("bf16 pages only") == 7  # 5 rows + 2 lines
    # --chunk of the sharded layout is not the paged layout's segment (and vice versa)
    rc, out = _run(capsys, "--batch", "1", "--seq", "131072", "--chunk", "16384")
    assert rc == 0 and "paged 171,008 tokens" in out
    rc, out = _run(capsys, "--batch", "1", "--seq", "12288", "--layout", "paged", "--chunk", "12288")
    assert rc == 0 and "activations of one 12288-token segment" in out and "paged 171,008 tokens" in out


def test_constants_are_the_vllm_neuron_models():
    """The planner may not import minimax_m3.vllm_neuron (a unit above it): its copy of the model's attention tile
    must stay equal to its home there (the segment rule's home is the planner: the dry run imports it)."""
    from minimax_m3.vllm_neuron.contract import Layout

    assert PAGED_TILE == Layout().tile


def test_fp8_experts_by_hand():
    """The plugin's ``quantization: "fp8"``: the routed experts per-channel e4m3 (1 byte a weight, fp32 scales per
    expert and output channel: ``weight_bytes``'s fp8 experts), and a segment's static MoE gathering e4m3 blocks and
    widening them (1 + 2 bytes a gathered weight, plus the gathered scales), or, ``dense``, widening every local
    expert once. TP 64 / ep_degree 64, 8K segments: 2 local experts on every token (``dense``); ep_degree 1,
    512-token segments: 2,048 rows over 128 experts in blocks (``ops.moe.blocks_capacity``)."""
    from minimax_m3.ops.moe import blocks_capacity, static_strategy
    from minimax_m3.planner import static_moe_bytes

    h, i = M3.hidden_size, M3.intermediate_size
    assert static_strategy(8192, 4, 2) == "dense"
    assert static_moe_bytes(M3, 64, 64, 8192, "fp8") - static_moe_bytes(M3, 64, 64, 8192) == 2 * 3 * h * i * 2
    assert static_strategy(512, 4, 128) == "blocks"
    n, _ = blocks_capacity(512 * 4, 128)
    i64 = i // 64
    assert static_moe_bytes(M3, 64, 1, 512, "fp8") - static_moe_bytes(M3, 64, 1, 512) == \
        n * (3 * h * i64 * 1 + (2 * i64 + h) * 4)
    bf16, fp8 = (plan(M3, 64, 64, 1, 131072, w, layout=PAGED) for w in ("bf16", "fp8"))
    experts = 57 * 2 * 3 * h * i  # 57 MoE layers x 2 local experts, bf16 -> fp8 halves their bytes
    assert bf16.weight_bytes - fp8.weight_bytes == experts - 57 * 2 * (2 * i + h) * 4
    assert fp8.fits and fp8.total_bytes < bf16.total_bytes
    assert largest_context(M3, 64, 64, 1, layout=PAGED, weights="fp8") > \
        largest_context(M3, 64, 64, 1, layout=PAGED)


# ---- decode context parallelism (vLLM's --decode-context-parallel-size, ``--dcp``) -----------------------------------
# The ranks that share a KV head (16 at TP 64) split into sequence shards: block n of every request on DCP rank
# n mod dcp, each request rounded up to whole virtual blocks of 128 x dcp tokens, so a rank holds 1/dcp of them.
ONE_M = 1 << 20


def hand_dcp_tokens(seq: int, dcp: int) -> int:
    """Tokens of one request's pages on one rank: ceil(S / (128 x dcp)) blocks of 128."""
    return -(-seq // (128 * dcp)) * 128


def test_dcp_pages_by_hand():
    one, sixteen = plan(M3, 64, 64, 1, ONE_M, layout=PAGED), plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=16)
    assert sixteen.dcp == 16 and one.dcp == 1
    assert sixteen.kv_bytes * 16 == one.kv_bytes and sixteen.index_k_bytes * 16 == one.index_k_bytes
    # ceil(S / (128 dcp)) x 128 tokens x L x 2 (K, V) x 1 KV head x 128 x 2 bytes; the index keys 57 x 128 x 2
    assert sixteen.kv_bytes == 512 * 128 * 60 * 2 * 1 * 128 * 2 == 65536 * KV_PER_TOKEN  # 1.875 GiB
    assert sixteen.index_k_bytes == 65536 * 57 * 128 * 2 == 65536 * INDEX_PER_TOKEN
    # a request is rounded up to whole virtual blocks: 1,000,000 tokens are 489 of 2,048, 62,592 tokens a rank
    assert hand_dcp_tokens(1_000_000, 16) == 62_592
    assert cache_bytes(M3, 64, 1, 1_000_000, PAGED, dcp=16) == (62_592 * KV_PER_TOKEN, 62_592 * INDEX_PER_TOKEN)
    # 3 requests of 1,000 tokens at dcp 2: 4 virtual blocks of 256 each (1,024 tokens), 512 tokens a rank each
    kv, ik = cache_bytes(M3, 64, 3, 1000, PAGED, dcp=2)
    assert kv + ik == 3 * 512 * PAGE_BYTES_PER_TOKEN
    # dcp 1 is the layout as it was
    assert plan(M3, 64, 64, 8, 131072, layout=PAGED, dcp=1) == plan(M3, 64, 64, 8, 131072, layout=PAGED)


def test_dcp_segment_working_memory_by_hand():
    """At 1M / dcp 16 a rank scores its own 65,536 keys (256 queries x fp32), pools into the whole line's 8,192
    blocks, gathers the 16 ranks' 16 candidates (fp32 score and id) and lays a dense layer's K and V line of its
    65,536 keys; the selected blocks' K/V and the selection as without DCP. MoE: unchanged."""
    p = plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=16)
    kept, _, moe = hand_segment_parts(64, ONE_M)
    t, keys = 256, 65536
    attention = (2 * t * 16 * 128 * D * 2 + t * 16 * 128 * 2 * 4 + t * keys * 4 + t * 8192 * 4 + t * 16 * 8
                 + t * 16 * 16 * 2 * 4 + 2 * keys * DI * 2)
    assert dict(p.phases) == {"attention tile": attention, "MoE": moe}
    assert p.prefill_bytes == kept + max(attention, moe)


def test_dcp_largest_context_by_hand():
    """Whole virtual blocks (2,048 tokens) left after weights, reserve and one 8K segment: the largest S with both
    ``base + attention(S) + S / 16 x 45,312`` and ``base + moe + S / 16 x 45,312`` within the rank, attention(S) =
    the sparse tile's fixed bytes + S / 16 x (256 x 4 index scores + 512 line) + S / 128 x 256 x 4 pooled."""
    kept, _, moe = hand_segment_parts(64, 131072)
    t = 256
    fixed = 2 * t * 16 * 128 * D * 2 + t * 16 * 128 * 2 * 4 + t * 16 * 8 + t * 16 * 16 * 2 * 4
    room = RANK - hand_weights(64) - RESERVE - kept
    by_attention = (room - fixed) * 16 // (PAGE_BYTES_PER_TOKEN + t * 4 + 2 * DI * 2 + t * 4 * 16 // 128)
    by_moe = (room - moe) * 16 // PAGE_BYTES_PER_TOKEN
    n = largest_context(M3, 64, 64, 1, layout=PAGED, dcp=16)
    assert n == min(by_attention, by_moe) // 2048 * 2048 == 2_727_936
    assert plan(M3, 64, 64, 1, n, layout=PAGED, dcp=16).fits
    assert not plan(M3, 64, 64, 1, n + 2048, layout=PAGED, dcp=16).fits
    assert largest_context(M3, 64, 64, 1, layout=PAGED, weights="fp8", dcp=16) > n


def test_dcp_segments():
    # the prefill buckets are multiples of dcp x 128: 2,048 at dcp 16 (so 512 and 1,024 are refused), 1,024 at 8
    for s in (2048, 4096, 8192):
        assert plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=16, chunk=s).chunk == s
    assert plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=8, chunk=1024).chunk == 1024
    assert plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=4, chunk=512).chunk == 512
    with pytest.raises(ChunkError, match=r"prefill segment \(--chunk\) 1024: with --dcp 16 .* multiples of dcp x "
                                         r"block = 16 x 128 = 2048 tokens .* one of 2048, 4096, 8192"):
        plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=16, chunk=1024)
    with pytest.raises(ChunkError, match=r"multiples of dcp x block = 8 x 128 = 1024 tokens .* one of 1024, 2048"):
        plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=8, chunk=512)
    # a short prompt in one call: rounded up to the virtual block (the default), not the prompt's own length
    assert plan(M3, 64, 64, 1, 5000, layout=PAGED, dcp=16).chunk == 6144
    assert plan(M3, 64, 64, 1, 5000, layout=PAGED, dcp=16, chunk=6144).chunk == 6144
    with pytest.raises(ChunkError, match=r"--seq rounded up to 2048 \(--chunk 6144\)"):
        plan(M3, 64, 64, 1, 5000, layout=PAGED, dcp=16, chunk=5000)


def test_dcp_refused():
    with pytest.raises(PlanError, match=r"--decode-context-parallel-size 3: 16 rank\(s\) hold each of the 4 KV heads "
                                        r"at --tensor-parallel-size 64; .* use one of \[1, 2, 4, 8, 16\]"):
        plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=3)
    with pytest.raises(PlanError, match=r"use one of \[1, 2, 4, 8, 16\]"):
        plan(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=32)
    for layout in ("sharded", "replicated"):
        with pytest.raises(PlanError, match=r"--dcp 16: decode context parallelism is the paged layout's \(vLLM's "
                                            r"--decode-context-parallel-size\)"):
            plan(M3, 64, 64, 1, 131072, layout=layout, dcp=16)


def _rows(rows: list[dict]) -> list[tuple]:
    return [(r["name"], r["kind"], r["ranks"], r["dtype"], r["bytes"], r["count"]) for r in rows]


def test_dcp_collectives_by_hand():
    """The attention step over the dcp ranks (ops.step.COLLECTIVES): per sparse layer one fp32 all-gather of the
    group's query heads and the ranks' 16 candidates (score, id), per dense layer a bf16 all-gather of the query
    heads, then per layer one fp32 all-to-all of the partial outputs with their max and sum: 2 more a layer."""
    one = collectives(M3, 64, 64, 1, PAGED)
    rows = collectives(M3, 64, 64, 1, PAGED, dcp=16)
    assert sum(r["count"] for r in rows) - sum(r["count"] for r in one) == 2 * 60
    assert sum(r["count"] for r in one) == 122 and sum(r["count"] for r in rows) == 242
    assert _rows(rows) == [("embedding", "all-reduce", 64, "bf16", H * 2, 1),
                           ("group queries", "all-gather", 16, "bf16", 16 * 128 * 2, 3),
                           ("group queries + selection candidates", "all-gather", 16, "fp32",
                            (16 * 128 + 16 * 1 * 16 * 2) * 4, 57),
                           ("partial outputs + max + sum", "all-to-all", 16, "fp32", 16 * 130 * 4, 60),
                           ("attention output", "all-reduce", 64, "bf16", H * 2, 60),
                           ("MLP / MoE output", "all-reduce", 64, "bf16", H * 2, 60),
                           ("LM head logits", "all-gather", 64, "fp32", 200064 * 4, 1)]
    # dcp 4: the query heads of 4 ranks
    assert [r["bytes"] for r in collectives(M3, 64, 64, 1, PAGED, dcp=4)][1:4] == \
        [4 * 128 * 2, (4 * 128 + 4 * 16 * 2) * 4, 4 * 130 * 4]
    # a prefill segment: the query heads, then (sparse layers) the candidates apart; no query split of the selection
    pre = collectives(M3, 64, 64, 8192, PAGED, logit_rows=1, phase="prefill", dcp=16)
    names = [(r["name"], r["count"]) for r in pre]
    assert ("group queries", 60) in names and ("selection candidates", 57) in names
    assert ("partial outputs + max + sum", 60) in names
    assert not any(n.startswith("selection ids") for n, _ in names)


def test_dcp_decode_itl_by_hand():
    """At 1M tokens, batch 1, ep 64: the index keys scored and the dense layers' K/V read are each rank's 65,536
    tokens; the 16 selected blocks' K/V read whole (the graph gathers every selected block, masking the ones another
    rank holds); 242 collectives, each under 25 us on the link at batch 1."""
    dcp1 = decode_minimum_bytes(M3, 64, 64, 1, ONE_M, layout=PAGED)
    dcp16 = decode_minimum_bytes(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=16)
    assert dcp16["kv_sparse"] == dcp1["kv_sparse"] == 16 * 128 * 512 * SPARSE
    assert dcp16["index_k"] * 16 == dcp1["index_k"] and dcp16["index_k"] == 65536 * DI * 2 * SPARSE
    assert dcp16["kv_dense"] * 16 == dcp1["kv_dense"] and dcp16["kv_dense"] == 65536 * 512 * DENSE
    read = (hand_weights(64) - 2 * VOCAB_RANK * H * 2 + (VOCAB_RANK + 1) * H * 2
            + 16 * 128 * 512 * SPARSE + 65536 * DI * 2 * SPARSE + 65536 * 512 * DENSE)
    itl = decode_itl(M3, 64, 64, 1, ONE_M, layout=PAGED, dcp=16)
    assert itl.bytes == read and itl.collectives == 242
    assert itl.total_s == pytest.approx(read / HBM + 242 * 25e-6, rel=1e-12)
    assert f"{itl.total_s * 1e3:.2f}" == "26.64"


def test_dcp_cli(capsys):
    rc, out = _run(capsys, "--tp", "64", "--ep", "64", "--batch", "1", "--seq", str(ONE_M), "--layout", "paged",
                   "--dcp", "16")
    assert rc == 0 and "paged caches (vLLM Neuron, DCP 16); per rank:" in out
    assert _gib(out, "KV cache") == round(65536 * KV_PER_TOKEN / GIB, 2) == 1.88
    assert "decode ITL estimate at batch 1, 1048576 tokens: 26.64 ms per step" in out and "242 collectives" in out
    assert "note: decode context parallelism 16 (vLLM's --decode-context-parallel-size)" in out
    assert "paged (vLLM Neuron, segments, DCP 16)" in out
    assert re.search(r"^largest context at batch 1: replicated [\d,]+ tokens; sharded [\d,]+ tokens; paged \(DCP 16\) "
                     r"2,727,936 tokens", out, re.M)
    # refusals: one line, exit 2
    for argv, said in ((["--layout", "paged", "--dcp", "3"], "minimax-m3 plan: --decode-context-parallel-size 3"),
                       (["--dcp", "16"], "minimax-m3 plan: --dcp 16: decode context parallelism is the paged"),
                       (["--layout", "paged", "--dcp", "16", "--chunk", "512"],
                        "minimax-m3 plan: prefill segment (--chunk) 512: with --dcp 16")):
        rc, out = _run(capsys, "--batch", "1", "--seq", str(ONE_M), *argv)
        assert rc == 2 and out.startswith(said) and out.count("\n") == 1
    # without --dcp the output is as before
    _, out = _run(capsys, "--batch", "1", "--seq", "131072", "--layout", "paged")
    assert "DCP" not in out and "decode context parallelism" not in out
