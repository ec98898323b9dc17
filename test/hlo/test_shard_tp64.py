"""NxD's own checkpoint sharding at TP=64 / EP=64 / LNC=2 equals the reference backend's shard plan, tensor by tensor.

A narrow MiniMax-M3 with the real head and expert counts (64 q heads, 4 KV heads, 4 index heads, 128 experts, top-4;
hidden 128, head_dim 8; one dense layer, two sparse MoE layers; :func:`nxd_shard_tp64.narrow_config`) is written as a
synthetic bf16 checkpoint in the release layout. NxD's ``ModelBuilder.shard_checkpoint`` (through NxDI's
``get_builder()``, the path of ``shard_weights``) shards it for all 64 ranks in a subprocess
(:mod:`test.support.hlo.nxd_shard_tp64`); the oracle is the reference backend's loader (``reference.loader.load_model``)
under ``ShardPlan(world=64, rank=r, ep=64)``: the parameters the reference model of rank r holds, sliced from the same
checkpoint. Every tensor of every rank is compared bit-exactly (both are slices of the same tensors); the key map and
every tensor that only one side has are stated in :mod:`test.support.hlo.nxd_shard_tp64` and checked here. Ranks 0, 1,
15, 16, 17 and 63 are also checked against index arithmetic done by hand on the release tensors themselves.

Needs the NxDI/NxD sources (``NXDI_SRC``/``NXD_SRC``) and the NxDI environment; otherwise one skip line.
"""

from __future__ import annotations

import pytest

from test.support.neuron import standins

_REASON = standins.missing_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

import torch  # noqa: E402

from test.support.hlo import nxd_shard_tp64 as S  # noqa: E402

SPOTLIGHT = (0, 1, 15, 16, 17, 63)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("narrow") / "m3", S.narrow_config(), seed=0)


@pytest.fixture(scope="module")
def nxd(ckpt, tmp_path_factory):
    """NxD's report and the 64 sharded checkpoints it wrote."""
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("nxd")
    report = S.run_nxd_sharding(ckpt, out)
    files = sorted(out.glob("tp*_sharded_checkpoint.safetensors"))
    ranks = [load_file(out / f"tp{r}_sharded_checkpoint.safetensors") for r in range(S.TP)]
    return report, ranks, len(files)


@pytest.fixture(scope="module")
def ref(ckpt):
    """The reference model's parameters for every rank (and the unsharded model), from its own loader."""
    from minimax_m3.reference.loader import load_model
    from minimax_m3.reference.parallel import ShardPlan

    c = S.narrow_config()
    plans = [ShardPlan(world=S.TP, rank=r, ep=S.EP) for r in range(S.TP)]
    ranks = [load_model(ckpt, dtype=torch.bfloat16, config=c, plan=p).state_dict() for p in plans]
    full = load_model(ckpt, dtype=torch.bfloat16, config=c).state_dict()
    return c, plans, ranks, full


@pytest.fixture(scope="module")
def release(ckpt):
    """The release tensors themselves (for the hand-indexed checks)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _only_keys(c) -> set[str]:
    return {k for t in S.NXD_ONLY for k in S.expand(t, c.num_layers) if _applies(k, c)}


def _applies(key: str, c) -> bool:
    if key.startswith("layers.") and ".moe." in key:
        return bool(c.moe_layers[int(key.split(".")[1])])
    return True


def test_layout_is_trn2_tp64_ep64_lnc2(nxd):
    report, _, n_files = nxd
    assert (report["tp"], report["world"], report["lnc"], report["moe_ep"], report["moe_tp"]) == (64, 64, 2, 64, 1)
    assert n_files == 64
    # one EP group of all 64 ranks in rank order, for prefill and decode: EP rank r = global rank r
    assert report["ep_meshes"] == {"cte": [list(range(64))], "tkg": [list(range(64))]}


def test_every_key_is_accounted_for(nxd, ref):
    report, ranks, _ = nxd
    c, _, ref_ranks, _ = ref
    pairs = S.key_pairs(set(ref_ranks[0]), c.num_layers)
    assert set(ref_ranks[0]) - {r for r, _ in pairs.values()} == set()  # no reference parameter is unmapped
    only = _only_keys(c)
    for r, shard in enumerate(ranks):
        assert set(shard) == set(pairs) | only, f"rank {r}: {set(shard) ^ (set(pairs) | only)}"
        assert set(ref_ranks[r]) == set(ref_ranks[0])
    # what NxD received from the converter: every key reaches the shards, only NxD's hooks add any
    hook_made = {k for t in S.HOOK_CREATED for k in S.expand(t, c.num_layers) if _applies(k, c)}
    assert set(ranks[0]) - set(report["received"]) == hook_made
    assert set(report["received"]) <= set(ranks[0])
    dropped = {k for t in S.NXD_DROPPED for k in S.expand(t, c.num_layers)}
    assert set(report["dropped"]) == dropped


def _expected(rel: str, ref_t: torch.Tensor, full_t: torch.Tensor, r: int, scale: float) -> torch.Tensor:
    if rel == "same":
        return ref_t
    if rel == "routed_scale":  # routed_scaling_factor folded into the expert down projection (a power of two)
        return (ref_t.float() * scale).to(ref_t.dtype)
    if rel == "fold":
        return 1.0 + ref_t.float()
    if rel == "hidden_cols":
        n = full_t.shape[1] // S.TP
        return full_t[:, r * n:(r + 1) * n]
    raise ValueError(rel)


def _mismatches(shard: dict, ref_sd: dict, full: dict, pairs: dict, r: int, scale: float) -> list[str]:
    bad = []
    for nk, (rk, rel) in pairs.items():
        got, want = shard[nk], _expected(rel, ref_sd[rk], full[rk], r, scale)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            bad.append(f"{nk} <- {rk} ({rel}): {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
    return bad


def test_every_rank_matches_the_reference_plan(nxd, ref):
    _, ranks, _ = nxd
    c, _, ref_ranks, full = ref
    pairs = S.key_pairs(set(ref_ranks[0]), c.num_layers)
    bad: dict[str, list[int]] = {}
    for r in range(S.TP):
        for m in _mismatches(ranks[r], ref_ranks[r], full, pairs, r, c.routed_scaling_factor):
            bad.setdefault(m, []).append(r)
    assert not bad, "NxD's shard differs from the reference plan:\n" + "\n".join(
        f"  {m} on ranks {rs[:8]}{'...' if len(rs) > 8 else ''} ({len(rs)})" for m, rs in bad.items())
    # the dtypes the port relies on: norms and router fp32, weights bf16
    for nk, (_, rel) in pairs.items():
        fp32 = rel == "fold" or "router" in nk
        assert ranks[17][nk].dtype == (torch.float32 if fp32 else torch.bfloat16), nk


def test_the_comparison_sees_a_wrong_rank(nxd, ref):
    """Control: rank 17's shards against rank 16's plan differ exactly where the rank matters."""
    _, ranks, _ = nxd
    c, _, ref_ranks, full = ref
    pairs = S.key_pairs(set(ref_ranks[0]), c.num_layers)
    scale = c.routed_scaling_factor
    bad = {m.split(" <- ")[0] for m in _mismatches(ranks[17], ref_ranks[16], full, pairs, 17, scale)}
    assert "layers.1.self_attn.qkv_proj.q_proj.weight" in bad
    assert "layers.1.moe.expert_mlps.mlp_op.gate_up_proj.weight" in bad
    assert "layers.0.mlp.gate_up_proj.weight" in bad and "lm_head.weight" in bad
    assert "layers.1.self_attn.qkv_proj.k_proj.weight" not in bad  # ranks 16 and 17 share KV head 1
    assert "layers.1.moe.router.linear_router.weight" not in bad  # replicated


def test_nxd_only_tensors(nxd, ref):
    _, ranks, _ = nxd
    c, plans, _, _ = ref
    i = c.intermediate_size
    for r, shard in enumerate(ranks):
        ints = {k: v for k, v in shard.items() if k.endswith(".rank")}
        assert len(ints) == 1 + c.num_layers + sum(c.moe_layers)
        for k, v in ints.items():
            assert v.dtype == torch.int32 and v.tolist() == [r], (r, k)
        for layer in (j for j in range(c.num_layers) if c.moe_layers[j]):
            p = f"layers.{layer}.moe.expert_mlps."
            assert shard[p + "spmd_rank.local_expert_indices"].tolist() == [list(plans[r].experts(c))], r
            gate_up_bias = torch.cat([torch.zeros(2, i), torch.ones(2, i)], dim=1).to(torch.bfloat16)
            assert torch.equal(shard[p + "mlp_op.gate_up_proj.bias"], gate_up_bias)
            assert torch.equal(shard[p + "mlp_op.down_proj.bias"], torch.zeros(2, c.hidden_size, dtype=torch.bfloat16))


@pytest.mark.parametrize("r", SPOTLIGHT)
def test_spotlight_ranks_by_hand(nxd, release, r):
    """Index arithmetic written out for TP=64/EP=64 on the release tensors (no ShardPlan involved)."""
    _, ranks, _ = nxd
    c = S.narrow_config()
    shard, d, h = ranks[r], c.head_dim, c.hidden_size
    g = r // 16  # KV head (and index head) of rank r: 64 q heads over 4 KV heads, replicated to 64 ranks
    lm = "language_model.model.layers"
    for L in range(c.num_layers):
        a, n = f"{lm}.{L}.self_attn", f"layers.{L}.self_attn"
        assert torch.equal(shard[f"{n}.qkv_proj.q_proj.weight"], release[f"{a}.q_proj.weight"][d * r:d * (r + 1)])
        for x in "kv":
            assert torch.equal(shard[f"{n}.qkv_proj.{x}_proj.weight"],
                               release[f"{a}.{x}_proj.weight"][d * g:d * (g + 1)])
        assert torch.equal(shard[f"{n}.o_proj.o_proj.weight"], release[f"{a}.o_proj.weight"][:, d * r:d * (r + 1)])
        assert torch.equal(shard[f"{n}.q_layernorm.weight"], 1.0 + release[f"{a}.q_norm.weight"].float())
        if c.sparse_layers[L]:
            di = c.index_head_dim
            assert torch.equal(shard[f"{n}.index_q_proj.weight"],
                               release[f"{a}.index_q_proj.weight"][di * g:di * (g + 1)])
            assert torch.equal(shard[f"{n}.index_k_proj.weight"], release[f"{a}.index_k_proj.weight"])
        if c.moe_layers[L]:
            m, k = f"{lm}.{L}.block_sparse_moe", f"layers.{L}.moe"
            assert torch.equal(shard[f"{k}.router.linear_router.weight"], release[f"{m}.gate.weight"])
            assert torch.equal(shard[f"{k}.router.e_score_correction_bias"], release[f"{m}.e_score_correction_bias"])
            for j, e in enumerate((2 * r, 2 * r + 1)):  # 128 experts / 64 EP ranks
                gu = torch.cat([release[f"{m}.experts.{e}.w1.weight"], release[f"{m}.experts.{e}.w3.weight"]]).t()
                assert torch.equal(shard[f"{k}.expert_mlps.mlp_op.gate_up_proj.weight"][j], gu)
                w2 = release[f"{m}.experts.{e}.w2.weight"]  # x routed_scaling_factor (2.0: exact in bf16)
                assert torch.equal(shard[f"{k}.expert_mlps.mlp_op.down_proj.weight"][j],
                                   (c.routed_scaling_factor * w2.float()).to(w2.dtype).t())
            mlp, src, inter = f"layers.{L}.shared_expert", f"{m}.shared_experts", c.shared_intermediate_size
        else:
            mlp, src, inter = f"layers.{L}.mlp", f"{lm}.{L}.mlp", c.dense_intermediate_size
        n_loc = inter // 64  # stride 2: rank r holds [gate_r | up_r]
        gate_r = release[f"{src}.gate_proj.weight"][n_loc * r:n_loc * (r + 1)]
        up_r = release[f"{src}.up_proj.weight"][n_loc * r:n_loc * (r + 1)]
        assert torch.equal(shard[f"{mlp}.gate_up_proj.weight"], torch.cat([gate_r, up_r]))
        assert torch.equal(shard[f"{mlp}.down_proj.weight"],
                           release[f"{src}.down_proj.weight"][:, n_loc * r:n_loc * (r + 1)])
    v = c.vocab_size // 64
    assert torch.equal(shard["lm_head.weight"], release["language_model.lm_head.weight"][v * r:v * (r + 1)])
    hc = h // 64
    assert torch.equal(shard["embed_tokens.weight"],
                       release["language_model.model.embed_tokens.weight"][:, hc * r:hc * (r + 1)])
    assert torch.equal(shard["norm.weight"], 1.0 + release["language_model.model.norm.weight"].float())
