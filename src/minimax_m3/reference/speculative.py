"""The reference backend's speculative steps (:class:`Speculation`, mixed into ``engine.SpeculativeProvider``): an
EAGLE3 drafter beside the target model.

The generation loop (:meth:`minimax_m3.engine.Engine.generate`) calls, per step of a group's live rows:
``propose`` (each row's drafter catches up on the target states it has not seen, then drafts ``k`` tokens; the loop
chooses each one), ``verify`` (ONE target forward per row over ``[last token, drafts...]`` at positions
``p .. p + k`` on that row's cache: the chunked-prefill path, ``ops.attention_step`` over the cache before ``p`` plus
the ``k + 1`` tokens, which the cache then writes) and ``accept`` (how many drafts the loop kept).

Rejected drafts leave K/V, index keys and draft-cache entries past the accepted prefix. They are never read: every
read is causal (attention keeps keys ``<=`` the query, the indexer scores ``-inf`` past it, decode reads the slots
``<`` its position), and the next verify writes positions ``p' = p + accepted + 1 ..`` before it attends, so every
slot a later query reads was rewritten first (tested: a poisoned cache past the position changes nothing).

Rows are verified one at a time (batch-1 forwards on a view of the row's cache): rows sit at different positions
and the reference's forward takes one ``kv_len`` per call. A batched verify needs per-row starts there (the Neuron
port's fused speculation has them).
"""

from __future__ import annotations

import copy

import torch

from ..engine.spec import EngineSpec
from ..engine.speculative import HostDrafter
from .cache import KVCache
from .model import M3Model


def row_cache(cache: KVCache, r: int) -> KVCache:
    """Row ``r`` of ``cache`` as a batch-1 cache of views (writes land in ``cache``)."""
    view = copy.copy(cache)
    view.k, view.v = [t[r:r + 1] for t in cache.k], [t[r:r + 1] for t in cache.v]
    view.index_k = {i: t[r:r + 1] for i, t in cache.index_k.items()}
    return view


class Speculation(HostDrafter):
    """The steps a :class:`~.engine.ReferenceProvider` gains to speculate (mixed in before it): ``drafter`` is an
    :class:`~.eagle3.Eagle3Drafter` or any object with its ``aux_layers``, ``reset``, ``extend`` and ``propose``;
    ``speculative_tokens`` is k. The provider's prefill keeps the states entering the drafter's ``aux_layers``."""

    def __init__(self, model: M3Model, spec: EngineSpec, drafter, k: int, **kw):
        super().__init__(model, spec, **kw)
        self.drafter, self.speculative_tokens = drafter, k
        self._verified: dict[int, tuple[int, list[int], torch.Tensor | None]] = {}

    @property
    def _taps(self) -> tuple[int, ...] | None:
        return tuple(self.drafter.aux_layers) or None

    def prefill(self, prompts: list[list[int]], slots: list[int], max_len: int) -> torch.Tensor:
        logits = super().prefill(prompts, slots, max_len)
        self.drafter.reset(len(prompts), self.max_seq_len)
        for r, p in enumerate(prompts):
            states = None if self._hidden is None else self._hidden[r, :len(p)]
            self.drafter.extend(r, 0, states, p[1:])
        self._hidden, self._verified = None, {}
        return logits

    def verify(self, slots: list[int], tokens: list[list[int]], positions: list[int]) -> list[torch.Tensor]:
        """Per row: float32 logits ``[len(tokens[i]), vocab]`` of ``tokens[i]`` placed at ``positions[i] ..`` (row
        ``j`` predicts the token after ``tokens[i][j]``), one target forward each."""
        out = []
        for r, toks, p in zip(slots, tokens, positions):
            s = len(toks)
            ids = torch.tensor([toks], device=self.device)
            pos = torch.arange(p, p + s, device=self.device).unsqueeze(0)
            res = self.model(ids, pos, row_cache(self._cache, r), p + s, decode=False, hidden_at=self._taps)
            logits, states = res if self._taps else (res, None)
            self._verified[r] = (p, toks, None if states is None else states[0])
            out.append(logits[0])
        self._sync()
        return out


class ScriptedDrafter:
    """A drafter with a KNOWN acceptance: it proposes, for generated token ``g`` of row ``r``, the token
    ``continuations[r][g]`` where ``agree[g]`` is true and another token elsewhere (no model runs). With the target's
    own greedy continuation (a plain greedy run) its drafts agree with the target exactly where ``agree`` says, so
    the acceptance length a pattern builds is known in advance: the calibration of the speculative mechanics
    (tests, ``scripts/bench_speculative.py``). Rows are a group's slots (prompt ``r`` of a ``generate`` call of at
    most ``max_batch`` prompts); ``g = 0`` is the token the prefill chose."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, continuations: list[list[int]], agree, vocab_size: int):
        self.continuations, self.agree, self.vocab = continuations, list(agree), vocab_size
        self._prompt_len: dict[int, int] = {}

    def reset(self, batch: int, max_len: int) -> None:
        self._prompt_len = {}

    def extend(self, row: int, start: int, states, tokens: list[int]) -> None:
        if start == 0:
            self._prompt_len[row] = len(tokens) + 1

    def propose(self, row: int, last: int, position: int, k: int, choose) -> list[int]:
        cont, out = self.continuations[row], []
        for j in range(k):
            g = position + 1 + j - self._prompt_len[row]
            right = cont[g] if g < len(cont) else 0
            tok = right if g < len(self.agree) and self.agree[g] else (right + 1) % self.vocab
            logits = torch.zeros(self.vocab)
            logits[tok] = 20.0
            out.append(int(choose(j, logits)))
        return out


def acceptance_blocks(accepted: list[int], k: int) -> list[bool]:
    """The ``agree`` pattern (for :class:`ScriptedDrafter`) under which the verify steps accept ``accepted[0]``,
    ``accepted[1]``, ... drafts in turn (each < k: then one disagreement; = k: all k, then the target's own token):
    entry 0 is the prefill's token, each step then covers ``a + 1`` generated tokens."""
    out = [True]
    for a in accepted:
        out += [True] * a + [a == k]
    return out
