"""What honouring structured outputs costs on the vllm-neuron 0.4.1 path (a script, not a test).

A build that samples on device returns one token id per request and step; a build that samples on the host (``compile
--for-vllm --structured-outputs``, the one where vLLM's grammar applies) returns every request's logits, which the
host then masks with the grammar's bitmask and samples. This prints, per batch size, side by side:

* the bytes a step moves off the device: ids (int32) vs float32 logits over M3's vocabulary (analytic; the TP ranks'
  vocabulary shards are gathered first: an all-gather of the same bytes);
* the host's time per step, measured here on this machine's CPU (not on a trn2 host): vLLM's own ``Sampler`` on the
  logits (greedy, and temperature + top-p), and xgrammar's bitmask applied first (what vllm-neuron's
  ``_apply_grammar_bitmask_from_output`` and vLLM's ``apply_grammar_bitmask`` do per constrained request).

Medians over ``--repeats`` runs. Needs vLLM (``.venv-vllm``):

    .venv-vllm/bin/python scripts/bench_host_sampling.py [--batches 1,8,32] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minimax_m3.config import M3Config


def _metadata(b: int, greedy: bool, vocab: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    z = torch.zeros(b)
    return SamplingMetadata(
        temperature=None if greedy else torch.full((b,), 0.7), all_greedy=greedy, all_random=not greedy,
        top_p=None if greedy else torch.full((b,), 0.95), top_k=None, generators={}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=z, presence_penalties=z,
        repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    import xgrammar as xgr
    from vllm.v1.sample.sampler import Sampler

    vocab = M3Config().vocab_size
    sampler = Sampler()
    words = (vocab + 31) // 32
    print(f"M3 vocabulary {vocab:,}; host figures on this machine's CPU ({torch.get_num_threads()} threads), "
          f"medians of {args.repeats}")
    print(f"{'batch':>5} | {'off device: ids':>15} | {'off device: logits':>18} | {'greedy ms':>9} | "
          f"{'top-p ms':>8} | {'bitmask + greedy ms':>19}")
    for b in (int(x) for x in args.batches.split(",")):
        g, t, m = _row(sampler, xgr, b, vocab, words, args.repeats)
        print(f"{b:>5} | {b * 4:>13} B | {b * vocab * 4 / 1e6:>15.2f} MB | {g:>9.2f} | {t:>8.2f} | {m:>19.2f}")


def _row(sampler, xgr, b: int, vocab: int, words: int, repeats: int) -> tuple[float, float, float]:
    logits = torch.randn(b, vocab)
    mask = torch.full((b, words), -1, dtype=torch.int32)  # every token allowed: the mask's cost, not its effect
    greedy, topp = _metadata(b, True, vocab), _metadata(b, False, vocab)

    def masked():
        x = logits.clone()
        xgr.apply_token_bitmask_inplace(x, mask)
        sampler(x, greedy)

    return (_median_ms(lambda: sampler(logits.clone(), greedy), repeats),
            _median_ms(lambda: sampler(logits.clone(), topp), repeats), _median_ms(masked, repeats))

if __name__ == "__main__":
    main()
