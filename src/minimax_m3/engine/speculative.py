"""Speculative decoding's token choices, one home: drafting a token, and verifying drafts against the target.

The generation loop drives a provider that can speculate (``propose`` k draft tokens, ``verify`` them in one target
forward, ``accept`` the outcome; see :class:`minimax_m3.engine.loop.StepProvider`) and decides here:

* target tokens chosen on the device (on-device sampling: :func:`verify_chosen`): drafts are kept while they equal
  the target's own choice at their position, so the output is plain decoding's with the same seeds, token for token;
* greedy: a draft is the argmax of the draft's logits; the longest prefix of drafts equal to the target's argmax is
  accepted, then the target's argmax at the first disagreement (or after the last draft) is appended. The output is
  plain greedy decoding's, token for token (up to logits tying within the rounding of the verify forward's path).
* sampling, speculative sampling (Leviathan et al. 2023, Chen et al. 2023): a draft ``y`` is drawn from ``q``, the
  draft's distribution after the request's temperature / top-k / top-p filter; it is accepted when
  ``u < p(y) / q(y)`` (``p``: the target's filtered distribution, as plain sampling draws from), else the token is
  drawn from ``max(0, p - q)`` normalised and the chain stops; after ``k`` accepted drafts one more token is drawn
  from ``p``. Each emitted token is distributed as ``p`` (the output distribution of plain sampling).

Every random number is ``ops.seeded_sampling.uniforms(seed, counter)`` with ``counter = 3 x position + purpose``
(purpose: the target draw, the acceptance test, the draft draw): a sequence's tokens are a function of its seed, its
positions and its own logits, whatever its batch-mates. A position's acceptance and target uniforms decide it once
(it is then settled); a draft uniform reused after a rejection was never looked at.
"""

from __future__ import annotations

import torch

from ..ops.sampling import filter_logits
from ..ops.seeded_sampling import seed_words, seeded_sample, uniforms

TARGET, ACCEPT, DRAFT = 0, 1, 2


def _words(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = seed_words(seed)
    return torch.tensor([lo]), torch.tensor([hi])


def uniform(seed: int, position: int, purpose: int) -> float:
    """The uniform in [0, 1) of ``(seed, position, purpose)``."""
    return float(_uniforms(seed, [position], purpose)[0])


def _uniforms(seed: int, positions: list[int], purpose: int) -> torch.Tensor:
    return uniforms(*_words(seed), torch.tensor([3 * p + purpose for p in positions]))


def distribution(logits: torch.Tensor, gen) -> torch.Tensor:
    """The distribution(s) ``[..., vocab]`` (float32, CPU) plain sampling draws from: ``gen``'s temperature, top-k,
    top-p."""
    x = logits.float().cpu()
    return torch.softmax(filter_logits(x.reshape(-1, x.shape[-1]), gen.temperature, gen.top_k, gen.top_p),
                         -1).view(x.shape)


def draw(probs: torch.Tensor, seed: int, position: int, purpose: int = TARGET) -> int:
    """A token from ``probs`` (any non-negative weights) at the uniform of ``(seed, position, purpose)``: the inverse
    CDF of :func:`ops.seeded_sampling.seeded_sample` (candidates by descending weight)."""
    counter = torch.tensor([3 * position + purpose])
    one = torch.ones(1)
    return int(seeded_sample(probs.log()[None], one, torch.zeros(1, dtype=torch.long), one, *_words(seed), counter)[0])


def sample_at(logits: torch.Tensor, gen, seed: int, position: int) -> int:
    """The token at ``position`` drawn from the target's ``logits`` (a speculating engine's non-drafted tokens)."""
    return draw(distribution(logits, gen), seed, position, TARGET)


def propose(logits: torch.Tensor, gen, seed: int, position: int) -> tuple[int, torch.Tensor | None]:
    """A draft token for ``position`` from the draft's ``logits`` and its distribution ``q`` (None when greedy)."""
    if gen.greedy:
        return int(logits.argmax()), None
    q = distribution(logits, gen)
    return draw(q, seed, position, DRAFT), q


def verify_chosen(chosen: list[int], drafts: list[int]) -> tuple[int, int]:
    """``(accepted, token)`` when the target's tokens were chosen on the device (``chosen[j]``: its token after
    draft ``j``, drawn or argmax as plain decoding would at that position): the longest prefix of drafts equal to
    the chosen tokens, then the chosen token after it. Every emitted token is the one plain decoding with the same
    seeds chooses, so the output equals it token for token (sampling included; a sampled draft is accepted only
    where it hits the target's own draw)."""
    a = next((j for j, y in enumerate(drafts) if y != chosen[j]), len(drafts))
    return a, chosen[a]


def verify(logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor | None], gen, seed: int,
           position: int) -> tuple[int, int]:
    """``(accepted, token)``: how many of ``drafts`` (for positions ``position ..``) the target's ``logits``
    ``[len(drafts) + 1, vocab]`` accept, and the token that follows them (module docstring)."""
    n = len(drafts)
    if gen.greedy:
        best = logits.argmax(-1).tolist()
        a = next((j for j, y in enumerate(drafts) if y != best[j]), n)
        return a, best[a]
    p = distribution(logits, gen)
    u = _uniforms(seed, list(range(position, position + n)), ACCEPT).tolist()
    for j, y in enumerate(drafts):
        if not u[j] * float(qs[j][y]) < float(p[j, y]):
            return j, draw((p[j] - qs[j]).clamp(min=0), seed, position + j, TARGET)
    return n, draw(p[n], seed, position + n, TARGET)


class HostDrafter:
    """The draft side of a provider whose drafter runs on the host (mixed in before the provider; the reference
    backend and the Neuron port): ``self.drafter`` (an EAGLE3 drafter or any object with its ``aux_layers``,
    ``reset``, ``extend`` and ``propose``) drafts for each row, and after a verify step catches up on the accepted
    prefix with the target's states there. The provider's ``verify`` records, per row, ``self._verified[row] =
    (position, tokens, target states [len(tokens), 3 x hidden] or None)``."""

    drafter = None
    _verified: dict

    def propose(self, slots: list[int], lasts: list[int], positions: list[int], ks: list[int],
                choose) -> list[list[int]]:
        """Per row: ``ks[i]`` drafts for the positions after ``positions[i]`` (whose token is ``lasts[i]``);
        ``choose(i, j, logits)`` picks draft ``j`` of row ``i``."""
        return [self.drafter.propose(r, last, p, k, lambda j, x, i=i: choose(i, j, x))
                for i, (r, last, p, k) in enumerate(zip(slots, lasts, positions, ks))]

    def accept(self, slots: list[int], accepted: list[int]) -> None:
        """Row ``slots[i]`` kept its last token and ``accepted[i]`` drafts of the last verify."""
        for r, a in zip(slots, accepted):
            p, toks, states = self._verified.pop(r)
            self.drafter.extend(r, p, None if states is None else states[:a + 1], toks[1:a + 1])
