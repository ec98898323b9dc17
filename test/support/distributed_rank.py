"""Child process of ``test_distributed.py``: one rank of a gloo process group running every requested layout.

Rank 0 writes ``{(ep, dtype): {"prefill": [...], "generate": [...]}}`` to ``out``; every rank checks that its logits are
bitwise those of rank 0 (all ranks must agree, or the engines would drift apart while generating).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run(rank: int, world: int, ckpt: str, init_file: str, out: str, eps: list[int], prompts, steps: int,
        dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    from minimax_m3 import GenerationConfig
    from minimax_m3.reference.engine import ReferenceEngine
    from minimax_m3.reference.loader import load_model
    from minimax_m3.reference.parallel import ShardPlan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for ep, dtype in [(ep, dt) for ep in eps for dt in dtypes]:
            if dtype == torch.float32:  # the torchrun route: the engine joins the group from the environment
                os.environ.update(WORLD_SIZE=str(world), MINIMAX_M3_EP=str(ep))
                eng = ReferenceEngine.from_pretrained(ckpt, device="cpu", dtype="float32", max_seq_len=256)
                assert eng.model.plan == ShardPlan(world=world, rank=rank, ep=ep)
            else:
                plan = ShardPlan(world=world, rank=rank, ep=ep)
                eng = ReferenceEngine(load_model(ckpt, "cpu", dtype, plan=plan), max_seq_len=256)
            pre = eng.prefill_logits(prompts)
            gen = eng.generate(prompts, GenerationConfig(max_new_tokens=steps, return_logits=True))
            mine = torch.cat([p.flatten() for p in pre] + [g.step_logits.flatten() for g in gen])
            ref = mine.clone()
            dist.broadcast(ref, src=0)
            if not torch.equal(mine, ref):
                raise AssertionError(f"rank {rank} ep={ep}: logits differ from rank 0's")
            results[ep, dtype] = {"prefill": pre, "generate": [(g.tokens, g.step_logits) for g in gen],
                           "params": sum(p.numel() for p in eng.model.parameters())}
        params = torch.tensor([[results[ep, dtypes[0]]["params"] for ep in eps]])
        gathered = [torch.zeros_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        if rank == 0:
            for i, ep in enumerate(eps):
                results[ep, dtypes[0]]["params_per_rank"] = [int(g[0, i]) for g in gathered]
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
