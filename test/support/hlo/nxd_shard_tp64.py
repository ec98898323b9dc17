"""NxD's own checkpoint sharding at TP=64 / EP=64 / LNC=2 on a narrow MiniMax-M3, and the key map to the reference.

``python -m test.support.hlo.nxd_shard_tp64 CKPT OUT`` (run by ``test_shard_tp64.py`` in a subprocess of the NxDI
environment, so NxD's process-global state — ``mock_distributed``, ``parallel_state``, the MoE process groups, env
vars — never leaks into other tests) builds ``NeuronMiniMaxM3ForCausalLM`` with the trn2.48xlarge layout of
``minimax_m3.config.parallel.TRN2`` (``--backend neuron``'s defaults) and runs
``get_builder().shard_checkpoint(serialize_path=OUT)``: NxD's
``ModelBuilder.shard_checkpoint`` under ``mock_distributed(64)`` on the meta device, one process, writing
``tp{r}_sharded_checkpoint.safetensors`` for r = 0..63 exactly as NxDI's ``shard_weights`` does with
``save_sharded_checkpoint``. It also writes ``report.json``: the converter's keys as NxD received them, the keys NxD
dropped as redundant (its warning, parsed), the expert-parallel meshes, the layout and the time taken.

NxD runs here *outside* NxDI's CPU mode (the stand-ins set ``NXD_CPU_MODE=1``; we unset it): in CPU mode NxD's
``initialize_model_parallel`` asks for gloo groups that ``mock_distributed`` cannot make, and on a trn2 host the
sharding runs outside CPU mode too. Sharding is host code either way.

The key map below is the test's statement of which sharded NxD key holds which reference parameter
(``checkpoint.nxdi_rules`` vs ``checkpoint.mapping``), and why NxD holds tensors the reference has none of.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
import warnings
from pathlib import Path

TP = EP = 64
LNC = 2


def narrow_config():
    """MiniMax-M3's real head and expert counts (64 q heads, 4 KV heads, 4 index heads, 128 experts, top-4) at
    tiny widths: hidden 128, head_dim 8, 3 layers (one dense, two sparse-attention MoE)."""
    from minimax_m3.config import M3Config

    return M3Config.preset("tiny").replace(
        vocab_size=512, hidden_size=128, num_layers=3, num_heads=64, num_kv_heads=4, head_dim=8, rotary_dim=4,
        intermediate_size=16, dense_intermediate_size=128, shared_intermediate_size=128, num_experts=128, top_k=4,
        moe_layers=(False, True, True), sparse_layers=(False, True, True), index_heads=4, index_head_dim=8)


# ---- the key map: NxD sharded key ← reference parameter (``{L}`` = layer) ------------------------------------------
# same:        bit-equal to the reference plan's slice for this rank, same dtype
# fold:        float32, equal to 1 + (the plan's slice in float32): the Gemma ``+1`` folded by nxdi_rules
# hidden_cols: columns [r*H/W, (r+1)*H/W) of the full tensor. NxD's ParallelEmbedding(shard_across_embedding=True)
#              splits the hidden dim; the reference plan splits the vocabulary (rows). Both are exact (NxD gathers
#              the columns, the reference all-reduces masked lookups): a layout difference, not a value difference.
KEY_MAP: tuple[tuple[str, str, str], ...] = (
    ("embed_tokens.weight", "embed_tokens.weight", "hidden_cols"),
    ("norm.weight", "norm.weight", "fold"),
    ("lm_head.weight", "lm_head.weight", "same"),
    ("layers.{L}.input_layernorm.weight", "layers.{L}.input_layernorm.weight", "fold"),
    ("layers.{L}.post_attention_layernorm.weight", "layers.{L}.post_attention_layernorm.weight", "fold"),
    ("layers.{L}.self_attn.qkv_proj.q_proj.weight", "layers.{L}.attn.q_proj.weight", "same"),
    ("layers.{L}.self_attn.qkv_proj.k_proj.weight", "layers.{L}.attn.k_proj.weight", "same"),
    ("layers.{L}.self_attn.qkv_proj.v_proj.weight", "layers.{L}.attn.v_proj.weight", "same"),
    ("layers.{L}.self_attn.o_proj.o_proj.weight", "layers.{L}.attn.o_proj.weight", "same"),
    ("layers.{L}.self_attn.q_layernorm.weight", "layers.{L}.attn.q_norm.weight", "fold"),
    ("layers.{L}.self_attn.k_layernorm.weight", "layers.{L}.attn.k_norm.weight", "fold"),
    ("layers.{L}.self_attn.index_q_proj.weight", "layers.{L}.attn.index_q_proj.weight", "same"),
    ("layers.{L}.self_attn.index_k_proj.weight", "layers.{L}.attn.index_k_proj.weight", "same"),
    ("layers.{L}.self_attn.index_q_norm.weight", "layers.{L}.attn.index_q_norm.weight", "fold"),
    ("layers.{L}.self_attn.index_k_norm.weight", "layers.{L}.attn.index_k_norm.weight", "fold"),
    ("layers.{L}.mlp.gate_up_proj.weight", "layers.{L}.mlp.gate_up_proj.weight", "same"),
    ("layers.{L}.mlp.down_proj.weight", "layers.{L}.mlp.down_proj.weight", "same"),
    ("layers.{L}.moe.router.linear_router.weight", "layers.{L}.moe.router.weight", "same"),
    ("layers.{L}.moe.router.e_score_correction_bias", "layers.{L}.moe.e_score_correction_bias", "same"),
    ("layers.{L}.moe.expert_mlps.mlp_op.gate_up_proj.weight", "layers.{L}.moe.experts.gate_up", "same"),
    ("layers.{L}.moe.expert_mlps.mlp_op.down_proj.weight", "layers.{L}.moe.experts.down", "routed_scale"),
    ("layers.{L}.shared_expert.gate_up_proj.weight", "layers.{L}.moe.shared.gate_up_proj.weight", "same"),
    ("layers.{L}.shared_expert.down_proj.weight", "layers.{L}.moe.shared.down_proj.weight", "same"),
)

# NxD keys with no reference counterpart, each checked against a hand-stated value by the test.
NXD_ONLY: dict[str, str] = {
    "rank_util.rank": "NxDI's SPMDRank (a stand-in for a replica id): nxdi_rules writes arange(tp) int32, NxD "
                      "gives rank r the one-element [r]",
    "layers.{L}.self_attn.rank_util.rank": "the attention's SPMDRank, as above: [r] int32",
    "layers.{L}.moe.expert_mlps.spmd_rank.rank": "written by ExpertMLPsV2.preshard_hook (create_spmd_ranks): [r]",
    "layers.{L}.moe.expert_mlps.spmd_rank.local_expert_indices":
        "written by ExpertMLPsV2.preshard_hook from NxD's EP mesh: the experts rank r's graph indexes; must be "
        "the reference plan's experts of rank r (the same experts its weight slices hold)",
    "layers.{L}.moe.expert_mlps.mlp_op.gate_up_proj.bias":
        "the release has no expert biases; nxdi_rules writes zeros because bias=True is how NxD computes "
        "SwiGLU-OAI's (up + 1): ExpertMLPsV2.preshard_hook adds hidden_act_bias=1 to the up half. Expected for "
        "each local expert: 0 on the gate half, 1 on the up half",
    "layers.{L}.moe.expert_mlps.mlp_op.down_proj.bias": "zeros from nxdi_rules, divided by moe_tp=1 by the hook: 0",
}
# Keys NxD's preprocess_checkpoint drops as "redundant" (not in the model): none. Before af0c924 it dropped
# ``layers.{L}.self_attn.o_proj.o_proj.o_proj.weight``, an alias GroupQueryAttention_O.preshard_hook's prefix rename
# made one ``o_proj`` deeper; the attention now names ``o_proj.o_proj`` as its checkpoint layer (an identity rename).
NXD_DROPPED: dict[str, str] = {}
# keys the shard holds that the converter did not write (NxD's hooks create them)
HOOK_CREATED = ("layers.{L}.moe.expert_mlps.spmd_rank.rank",
                "layers.{L}.moe.expert_mlps.spmd_rank.local_expert_indices")


def expand(template: str, num_layers: int) -> list[str]:
    return [template.replace("{L}", str(i)) for i in range(num_layers)] if "{L}" in template else [template]


def key_pairs(ref_keys, num_layers: int) -> dict[str, tuple[str, str]]:
    """``{nxd_key: (ref_key, relation)}`` for every reference key the map covers."""
    out = {}
    for nxd, ref, rel in KEY_MAP:
        for n, r in zip(expand(nxd, num_layers), expand(ref, num_layers)):
            if r in ref_keys:
                out[n] = (r, rel)
    return out


# ---- the subprocess: NxD's sharding --------------------------------------------------------------------------------
def _shard(ckpt: str, out: Path) -> dict:
    from neuronx_distributed.modules.moe.moe_process_group import get_moe_ep_group

    from minimax_m3.config import M3Config
    from minimax_m3.engine.spec import EngineSpec
    from minimax_m3.neuron.build import inference_config
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM

    m3 = M3Config.from_pretrained(ckpt)
    # --backend neuron's defaults: the trn2 layout (config.parallel.TRN2), bfloat16, sharded weights saved
    spec = EngineSpec(ckpt, backend="neuron", max_batch=1, max_seq_len=256, context_buckets=(256,),
                      token_buckets=(256,)).resolve(m3)
    app = NeuronMiniMaxM3ForCausalLM(ckpt, inference_config(spec, m3, attn_kernel_enabled=False))
    nc = app.neuron_config
    builder = app.get_builder()
    received: dict = {}
    loader = builder.checkpoint_loader

    def recording_loader(*a, **k):  # what NxD receives from the port's converter, before any hook runs
        sd = loader(*a, **k)
        received.update({k_: [str(v.dtype), list(v.shape)] for k_, v in sd.items()})
        return sd

    builder.checkpoint_loader = recording_loader
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        builder.shard_checkpoint(serialize_path=str(out))
    seconds = time.perf_counter() - t0
    dropped = []
    for w in caught:
        msg = str(w.message)
        if msg.startswith("Removing redundant keys from checkpoint: "):
            dropped += ast.literal_eval(msg.split(": ", 1)[1])
    meshes = {name: [list(g) for g in get_moe_ep_group(prefill=p)._mesh] for name, p in (("cte", True), ("tkg", False))}
    return {"tp": nc.tp_degree, "world": nc.world_size, "lnc": nc.logical_nc_config, "moe_ep": nc.moe_ep_degree,
            "moe_tp": nc.moe_tp_degree, "ep_meshes": meshes, "received": received, "dropped": dropped,
            "submodel": list(builder.model_collection)[0], "shard_seconds": seconds}


def run_nxd_sharding(ckpt: Path, out: Path, timeout: float = 300) -> dict:
    """Run :func:`main` in a fresh interpreter (this one's: the NxDI environment); returns ``report.json``."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-m", "test.support.hlo.nxd_shard_tp64", str(ckpt), str(out)], cwd=root,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"NxD sharding subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((out / "report.json").read_text())


def main(argv: list[str]) -> int:
    ckpt, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    os.environ["BASE_COMPILE_WORK_DIR"] = str(out / "work") + "/"  # NxDI's builder work dir: not the shared /tmp

    from test.support.neuron import standins

    standins.bootstrap()
    os.environ.pop("NXD_CPU_MODE", None)  # NxD's real (device) sharding path, see the module docstring
    report = _shard(ckpt, out)
    (out / "report.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
