"""EAGLE3 draft checkpoints: read, validate against the target, synthesise (``minimax-m3 synth --draft eagle3``).

The layout vLLM's and SGLang's ``llama_eagle3`` models load (safetensors, one file or an index; keys without the
``model.`` prefix, the decoder layer as ``midlayer.`` or ``layers.0.``; H the draft's hidden size, Ht the target's,
V the target vocabulary, Vd the draft vocabulary):

==================================================  =================  =================================================
key                                                 shape              role
==================================================  =================  =================================================
``fc.weight``                                       ``[H, 3 Ht]``      the three target hidden states, concatenated
``midlayer.input_layernorm.weight``                 ``[H]``            RMSNorm of the embedded token
``midlayer.hidden_norm.weight``                     ``[H]``            RMSNorm of the fc output (or the draft's state)
``midlayer.self_attn.{q,k,v}_proj.weight``          ``[heads d, 2 H]`` over ``cat(embedding, hidden)``
``midlayer.self_attn.o_proj.weight``                ``[H, heads d]``
``midlayer.post_attention_layernorm.weight``        ``[H]``
``midlayer.mlp.{gate,up}_proj.weight`` / ``down``   ``[I, H]/[H, I]``  SiLU MLP
``norm.weight``                                     ``[H]``            before the lm_head
``lm_head.weight``                                  ``[Vd, H]``        absent: the target's (needs Vd = V)
``d2t``                                             ``[Vd]`` int64     target id = draft id + d2t[draft id]
``t2d``                                             ``[V]`` bool       which target ids the draft can propose (optional)
``embed_tokens.weight``                             ``[V, H]``         absent: the target's (needs H = Ht)
==================================================  =================  =================================================

:func:`check_draft` never raises: it lists every problem (config, missing / unexpected / misshapen tensors, a
``d2t`` that maps outside the vocabulary, a mismatch with the target); :func:`open_draft` raises them as ONE
:class:`DraftError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .._atomic import staged_directory
from ..config.draft import DraftConfig, default_aux_layers, is_draft_config, parse_draft_config
from ..config.m3 import M3Config
from ..errors import M3Error
from .reader import CheckpointError, CheckpointReader

LAYER = "layer."  # the canonical prefix of the decoder layer (stored as midlayer. or layers.0.)
_ALIASES = (("model.", ""), ("midlayer.", LAYER), ("layers.0.", LAYER))


class DraftError(M3Error, ValueError):
    """An EAGLE3 draft this package cannot run with the target: every problem, found before any work."""

    def __init__(self, problems, source: str = "draft"):
        problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(problems, f"{source}: {len(problems)} problem(s):")


def canonical(key: str) -> str:
    """A stored key in the canonical naming of the table above (``model.`` dropped, the layer as ``layer.``)."""
    for old, new in _ALIASES:
        if key.startswith(old):
            key = new + key[len(old):]
    return key


def expected(dc: DraftConfig) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """canonical key -> (shape, kind, required): kind ``float`` | ``int`` | ``bool``. ``lm_head``, ``d2t`` and
    ``embed_tokens`` are required or optional by the rules of the module table."""
    h, i, d = dc.hidden_size, dc.intermediate_size, dc.head_dim
    q, kv = dc.num_heads * d, dc.num_kv_heads * d
    a = LAYER + "self_attn."
    out = {"fc.weight": ((h, 3 * dc.target_hidden_size), "float", True), "norm.weight": ((h,), "float", True)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"{LAYER}{n}.weight"] = ((h,), "float", True)
    out.update({a + "q_proj.weight": ((q, 2 * h), "float", True), a + "k_proj.weight": ((kv, 2 * h), "float", True),
                a + "v_proj.weight": ((kv, 2 * h), "float", True), a + "o_proj.weight": ((h, q), "float", True)})
    for n, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        out[f"{LAYER}mlp.{n}.weight"] = (shape, "float", True)
    full = dc.draft_vocab_size == dc.vocab_size
    out["lm_head.weight"] = ((dc.draft_vocab_size, h), "float", not (full or dc.tie_word_embeddings))
    out["d2t"] = ((dc.draft_vocab_size,), "int", not full)
    out["t2d"] = ((dc.vocab_size,), "bool", False)
    out["embed_tokens.weight"] = ((dc.vocab_size, h), "float", h != dc.target_hidden_size)
    return out


@dataclass
class DraftReport:
    path: Path
    config: DraftConfig | None = None
    problems: list[str] = field(default_factory=list)
    stored: dict[str, str] = field(default_factory=dict)  # canonical -> stored key
    reader: CheckpointReader | None = None
    nbytes: int = 0

    def raise_if_problems(self) -> None:
        if self.problems:
            raise DraftError(self.problems, f"EAGLE3 draft {self.path}")


def read_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError([f"no config.json in {path}; point at a draft checkpoint directory"], str(path))
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError([f"config.json: unreadable ({exc})"], str(path)) from None


def _tensor_problems(rep: DraftReport, dc: DraftConfig) -> None:
    r, want, bad = rep.reader, expected(dc), set()
    for key in r.keys():
        c = canonical(key)
        if c not in want:
            rep.problems.append(f"unexpected tensor {key!r}: not part of a one-layer EAGLE3 Llama draft")
        elif c in rep.stored:
            rep.problems.append(f"tensor {c!r} stored twice ({rep.stored[c]!r} and {key!r})")
        else:
            rep.stored[c] = key
    for c, (shape, kind, required) in want.items():
        key = rep.stored.get(c)
        if key is None:
            if required:
                rep.problems.append(f"missing tensor {c!r} {list(shape)}")
            continue
        info = r.info(key)
        ok = {"float": info.dtype.is_floating_point, "bool": info.dtype == torch.bool,
              "int": not info.dtype.is_floating_point and info.dtype != torch.bool}[kind]
        if tuple(info.shape) != shape or not ok:
            bad.add(c)
            rep.problems.append(f"tensor {key!r} is {str(info.dtype).removeprefix('torch.')}{list(info.shape)}, "
                                f"expected a {kind} tensor {list(shape)} for this config")
    if "d2t" in rep.stored and "d2t" not in bad:
        ids = torch.arange(dc.draft_vocab_size) + r.get(rep.stored["d2t"]).long()
        if ids.min() < 0 or ids.max() >= dc.vocab_size or ids.unique().numel() != ids.numel():
            rep.problems.append(f"d2t maps draft ids outside the target vocabulary [0, {dc.vocab_size}) or two draft "
                                "ids to one target id")
        elif "t2d" in rep.stored and "t2d" not in bad:
            t2d = r.get(rep.stored["t2d"])
            if int(t2d.sum()) != dc.draft_vocab_size or not bool(t2d[ids].all()):
                rep.problems.append("t2d does not mark exactly the target ids d2t maps to")


def draft_config(path: str | Path, target: M3Config) -> DraftConfig:
    """The config of the draft at ``path``, checked against ``target`` (one :class:`DraftError` listing every
    problem), reading ``config.json`` only: what a build needs of a draft (the target states it reads), before the
    drafter loads its tensors (:func:`open_draft` checks those)."""
    try:
        raw = read_config(Path(path))
    except CheckpointError as exc:
        raise DraftError(exc.problems, f"EAGLE3 draft {path}") from None
    problems = [] if is_draft_config(raw) else [
        "config.json describes no EAGLE3 draft (no eagle_config, draft architecture or transformer_layer_config): "
        "is this the target checkpoint?"]
    dc, found = parse_draft_config(raw)
    problems += found + (dc.target_problems(target) if dc is not None else [])
    if problems:
        raise DraftError(problems, f"EAGLE3 draft {path}")
    return dc


def check_draft(path: str | Path, target: M3Config | None = None) -> DraftReport:
    """Every problem of the draft at ``path`` (with ``target``: also its fit to the target). Never raises."""
    rep = DraftReport(Path(path))
    try:
        raw = read_config(rep.path)
        rep.reader = CheckpointReader(rep.path, strict=False)
    except CheckpointError as exc:
        rep.problems += exc.problems
        return rep
    rep.problems += rep.reader.problems
    if not is_draft_config(raw):
        rep.problems.append("config.json describes no EAGLE3 draft (no eagle_config, draft architecture or "
                            "transformer_layer_config): is this the target checkpoint?")
    rep.config, problems = parse_draft_config(raw)
    rep.problems += problems
    rep.nbytes = sum(i.nbytes for i in rep.reader.infos.values())
    if rep.config is not None:
        _tensor_problems(rep, rep.config)
        if target is not None:
            rep.problems += rep.config.target_problems(target)
    return rep


def open_draft(path: str | Path, target: M3Config) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """The draft's config and its tensors by canonical key (as stored: the caller casts), or one
    :class:`DraftError` listing every problem."""
    rep = check_draft(path, target)
    rep.raise_if_problems()
    return rep.config, {c: rep.reader.get(k).clone() for c, k in rep.stored.items()}


SHARED = ("embed_tokens.weight", "lm_head.weight")  # what a draft may take from its target


def target_shared(dc: DraftConfig, stored: dict, target_path: str | Path, target: M3Config) -> dict[str, torch.Tensor]:
    """The target's tensors a draft stores none of (``SHARED``, by the draft's names), read from the target
    checkpoint at ``target_path`` (any published format, full precision): for an engine that holds no torch copy
    of the target (the Neuron port shards its own)."""
    from .mapping import LM
    from .validate import open_checkpoint

    want = [k for k in SHARED if k not in stored]
    if not want:
        return {}
    src = open_checkpoint(target_path, target, False).source
    embed = src.get(f"{LM}.embed_tokens.weight")
    out = {"embed_tokens.weight": embed}
    if "lm_head.weight" in want and not dc.tie_word_embeddings:
        out["lm_head.weight"] = embed if target.tie_word_embeddings else src.get("language_model.lm_head.weight")
    return {k: v for k, v in out.items() if k in want}


def draft_info(path: str | Path, target: M3Config | None = None) -> dict:
    """What ``minimax-m3 inspect DRAFT`` prints, as a dict (never raises for a bad draft: problems are listed)."""
    rep = check_draft(path, target)
    info: dict = {"path": str(path), "problems": rep.problems, "format_description": "EAGLE3 draft (unreadable)"}
    dc = rep.config
    if dc is not None:
        info["format_description"] = f"EAGLE3 draft ({dc.form} config form)"
        info["config"] = {"layers": dc.num_layers, "hidden": dc.hidden_size, "heads": dc.num_heads,
                          "kv_heads": dc.num_kv_heads, "head_dim": dc.head_dim,
                          "intermediate": dc.intermediate_size, "vocab": dc.vocab_size,
                          "draft_vocab": dc.draft_vocab_size, "target_hidden": dc.target_hidden_size,
                          "aux_layer_ids": list(dc.aux_layer_ids) if dc.aux_layer_ids else
                          ("target default" if target is None else list(default_aux_layers(target.num_layers)))}
    if rep.reader is not None:
        info.update({"stored_tensors": len(rep.reader.infos), "stored_bytes": rep.nbytes,
                     "shards": len({i.shard for i in rep.reader.infos.values()}),
                     "shared_with_target": [k for k in SHARED[::-1]
                                            if dc is not None and k not in rep.stored]})
    return info


# ---- synthetic drafts -----------------------------------------------------------------------------------------------

def synthetic_config(target: M3Config, draft_vocab: int | None = None) -> DraftConfig:
    """A small draft for ``target``: hidden = the target's, MHA heads of the target's head_dim (as the published
    ``MiniMax-M3-EAGLE3``'s attention is MHA), intermediate 2 x hidden, a draft vocabulary of half the target's (so
    ``d2t`` / ``t2d`` are exercised), the aux ids written out (vLLM's default when it is valid for the target, else
    three spread ids)."""
    h, d, n = target.hidden_size, target.head_dim, target.num_layers
    ids = default_aux_layers(n)
    if len(set(ids)) != 3 or min(ids) < 0:
        ids = (1, n // 2, n - 1)
    return DraftConfig(hidden_size=h, num_heads=max(1, h // d), num_kv_heads=max(1, h // d), head_dim=d,
                       intermediate_size=2 * h, vocab_size=target.vocab_size,
                       draft_vocab_size=draft_vocab or target.vocab_size // 2, target_hidden_size=h,
                       rms_norm_eps=target.rms_norm_eps, rope_theta=10000.0, aux_layer_ids=tuple(ids))


def synthetic_tensors(dc: DraftConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights (stored keys, ``midlayer.`` naming) scaled so activations stay O(1); Llama norm
    weights near 1; a random ``d2t`` / ``t2d`` pair when the draft vocabulary is smaller."""
    g = torch.Generator().manual_seed(seed)

    def lin(o, i, gain=1.0):
        return (torch.randn(o, i, generator=g) * gain / math.sqrt(i)).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.2 * torch.randn(n, generator=g)).to(torch.bfloat16)

    out = {}
    for c, (shape, kind, _) in expected(dc).items():
        stored = c.replace(LAYER, "midlayer.")
        if kind == "float" and c.endswith("norm.weight"):
            out[stored] = norm(shape[0])
        elif kind == "float" and c not in ("lm_head.weight", "embed_tokens.weight"):
            out[stored] = lin(*shape)
    out["lm_head.weight"] = lin(dc.draft_vocab_size, dc.hidden_size, 4.0)
    if dc.draft_vocab_size < dc.vocab_size:
        ids = torch.randperm(dc.vocab_size, generator=g)[:dc.draft_vocab_size].sort().values
        out["d2t"] = ids - torch.arange(dc.draft_vocab_size)
        out["t2d"] = torch.zeros(dc.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return out


def write_synthetic_draft(out: str | Path, target: M3Config, seed: int = 0, force: bool = False,
                          config: DraftConfig | None = None) -> Path:
    """Write a synthetic EAGLE3 draft for ``target`` (config.json + model.safetensors) atomically."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; choose another OUT or pass --force")
    dc = config or synthetic_config(target)
    problems = dc.target_problems(target)
    if problems:
        raise DraftError(problems, "synthetic draft")
    with staged_directory(out) as tmp:
        save_file({k: t.contiguous() for k, t in synthetic_tensors(dc, seed).items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(dc.to_dict(), indent=2) + "\n")
    return out
