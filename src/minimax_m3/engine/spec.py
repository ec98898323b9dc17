"""``EngineSpec``: one typed description of an engine to load (backend, model, lengths, batch, layout, buckets,
compiled artifacts), its per-backend defaults, its validation and the command-line options that build it.

A leaf module (imports only the standard library, :mod:`minimax_m3.config` and the bucket and chunk rules of
:mod:`.buckets`, re-exported here; torch and ``ops`` lazily, where a spec is resolved or checked against a model): the
engine, the backends and every command read it. Defaults are resolved in one place, :meth:`EngineSpec.resolve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import parallel
from .._atomic import write_atomic
from ..config.m3 import ConfigError, M3Config
from ..errors import M3Error
from .buckets import (  # noqa: F401  (re-exported: compile, neuron.config and the tests import them from here)
    DEFAULT_CONTEXT_BUCKETS, bucket_problems, chunk_problems, context_buckets, default_buckets, token_buckets,
)

BACKENDS = ("reference", "neuron", "neuron-cpu")
DTYPES = ("float32", "bfloat16")
ARTIFACT_FILE = "minimax-m3-spec.json"  # in a compiled directory: the artifact key it was built for
# the fields that change the compiled NEFFs (and so name the artifact directory)
ARTIFACT_FIELDS = ("tp", "ep", "lnc", "dtype", "max_batch", "max_seq_len", "max_context_len", "context_buckets",
                   "token_buckets", "continuous_batching", "all_logits", "on_device_sampling", "weights",
                   "prefill_chunk", "draft", "num_speculative_tokens", "fused_speculation",
                   "decode_experts", "kv_layout")
# artifact fields added after records were first written: a record without one was compiled with this value
_RECORD_DEFAULTS = {"weights": "bf16", "draft": None, "num_speculative_tokens": None, "fused_speculation": False,
                    "decode_experts": "ep", "kv_layout": "sharded"}
WEIGHTS = ("bf16", "fp8")
DECODE_EXPERTS = parallel.DECODE_EXPERTS
KV_LAYOUTS = parallel.KV_LAYOUTS


class SpecError(ConfigError):
    """An engine spec the backend cannot run: every problem, found before any work."""

    def __init__(self, problems, source: str = "engine spec"):
        problems = [problems] if isinstance(problems, str) else list(problems)
        M3Error.__init__(self, problems, f"{source}: {len(problems)} problem(s):")


def _neuron(backend: str) -> bool:
    return backend in ("neuron", "neuron-cpu")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


@dataclass(frozen=True)
class EngineSpec:
    """Everything that decides which engine :func:`minimax_m3.load_engine` builds. ``None`` means the backend's
    default, filled in by :meth:`resolve` (see the README's "Engine spec" table)."""

    model: str  # checkpoint directory or s3://bucket/prefix
    backend: str = "reference"
    device: str | None = None  # reference: cpu | cuda | cuda:N (default: the best local one)
    dtype: str | None = None  # float32 | bfloat16 (default: bfloat16 on neuron and CUDA, float32 on CPU)
    max_seq_len: int = 4096  # prompt + generated tokens per sequence (neuron: the KV cache length)
    max_context_len: int | None = None  # longest prompt (neuron: max_context_length); default max_seq_len
    max_batch: int | None = None  # sequences decoded together (default: 8 reference, 1 neuron)
    tp: int | None = None  # tensor parallel degree (neuron: 64; neuron-cpu and reference: torchrun's WORLD_SIZE)
    ep: int | None = None  # expert parallel degree (neuron: tp; reference: $MINIMAX_M3_EP under torchrun, else 1)
    lnc: int | None = None  # logical NeuronCore config (neuron: 2 on trn2; neuron-cpu: 1)
    context_buckets: tuple[int, ...] | None = None  # neuron prefill buckets (default: context_buckets())
    token_buckets: tuple[int, ...] | None = None  # neuron decode buckets (default: token_buckets(); CPU mode: one)
    compiled: str | None = None  # neuron: the artifact directory (default: under the model, named by the spec)
    continuous_batching: bool | None = None  # neuron: one prefill per request into its slot (default: max_batch > 1)
    all_logits: bool | None = None  # neuron: prefill returns every position's logits (default: on in CPU mode)
    on_device_sampling: bool = False  # neuron: decode returns chosen ids (the loop then samples nothing)
    weights: str = "bf16"  # neuron: routed experts bf16 | fp8 (checkpoint.fp8_experts: NxD's per-channel e4m3)
    prefill_chunk: int | None = None  # tokens per prefill call (reference: ops.call_tokens; neuron: the planner's)
    tile: int = 256  # reference: prefill query tile
    cache_dir: str | None = None  # where s3:// models are downloaded
    draft: str | None = None  # an EAGLE3 draft checkpoint: speculative decoding
    num_speculative_tokens: int | None = None  # drafts per step with a draft (default 3)
    fused_speculation: bool = False  # neuron: the draft runs inside the device graph (NxDI's fused speculation)
    decode_experts: str = "ep"  # neuron: decode reads the routed experts as prefill's EP shards | a TP copy
    kv_layout: str = "sharded"  # neuron: caches split by sequence over a KV head's ranks | NxDI's GQA copies

    # ---- defaults ---------------------------------------------------------------------------------------------
    def resolve(self, config: M3Config | None = None) -> "EngineSpec":
        """A copy with every backend default filled in; bucket defaults need the model's ``config`` (indexer
        block). The one place defaults live."""
        b, neuron = self.backend, _neuron(self.backend)
        device = self.device
        if b == "reference" and device is None:
            device = _best_device()
        dtype = self.dtype
        if dtype is None:
            dtype = "bfloat16" if b == "neuron" or (device or "").startswith("cuda") else "float32"
        tp = self.tp
        if tp is None:
            tp = parallel.TRN2["tp"] if b == "neuron" else _world_size()
        ep = self.ep
        if ep is None:
            ep = tp if b == "neuron" else int(os.environ.get("MINIMAX_M3_EP", "1") or 1) if _world_size() > 1 else 1
        lnc = self.lnc if self.lnc is not None else (parallel.TRN2["lnc"] if b == "neuron" else 1)
        batch = self.max_batch if self.max_batch is not None else (1 if neuron else 8)
        ctx = self.max_context_len or (max(self.context_buckets) if self.context_buckets and not self.prefill_chunk
                                       else self.max_seq_len)
        chunk = self.prefill_chunk
        if chunk is None and config is not None:  # one prompt per call up to the cap (sharding's module doc)
            chunk = parallel.default_prefill_chunk(config, tp, ctx, self.kv_layout) if neuron else \
                _call_tokens(config)
        kw = dict(device=device, dtype=dtype, tp=tp, ep=ep, lnc=lnc, max_batch=batch, max_context_len=ctx,
                  prefill_chunk=chunk)
        if self.draft and self.num_speculative_tokens is None:
            kw["num_speculative_tokens"] = 3
        if neuron:
            kw["continuous_batching"] = batch > 1 if self.continuous_batching is None else self.continuous_batching
            kw["all_logits"] = (b == "neuron-cpu" and not self.fused_speculation) if self.all_logits is None \
                else self.all_logits
            # a prefill call is at most one chunk: the buckets end at the chunk (or the context, when shorter)
            kw["context_buckets"] = tuple(sorted(self.context_buckets or context_buckets(min(ctx, chunk or ctx))))
            if self.token_buckets:
                kw["token_buckets"] = tuple(sorted(self.token_buckets))
            elif b == "neuron-cpu":  # CPU mode runs one decode module as long as the cache (see _neuron_problems)
                kw["token_buckets"] = (self.max_seq_len,)
            elif config is not None:
                kw["token_buckets"] = tuple(token_buckets(self.max_seq_len, config.index_block_size))
        return dataclasses.replace(self, **kw)

    # ---- validation -------------------------------------------------------------------------------------------
    def problems(self, config: M3Config | None = None) -> list[str]:
        """Every reason this spec cannot run (on the resolved spec; ``config``: the model's, for layout rules)."""
        s = self.resolve(config)
        out: list[str] = []
        neuron = _neuron(s.backend)
        if s.backend not in BACKENDS:
            out.append(f"unknown backend {s.backend!r}: choose one of {', '.join(BACKENDS)}")
        if s.dtype not in DTYPES:
            out.append(f"unknown dtype {s.dtype!r}: choose float32 or bfloat16 (--dtype)")
        for name, value in (("max_seq_len (--max-seq-len)", s.max_seq_len), ("max_batch (--batch)", s.max_batch),
                            ("tp (--tp)", s.tp), ("ep (--ep)", s.ep), ("lnc (--lnc)", s.lnc), ("tile", s.tile)):
            if value < 1:
                out.append(f"{name} must be >= 1, got {value}")
        if s.weights not in WEIGHTS:
            out.append(f"unknown weights {s.weights!r}: choose bf16 or fp8 (--weights)")
        if s.decode_experts not in DECODE_EXPERTS:
            out.append(f"unknown decode_experts {s.decode_experts!r}: choose ep (the prefill's expert shards) or tp "
                       "(a tensor-parallel copy read by selected expert) (--decode-experts)")
        if s.kv_layout not in KV_LAYOUTS:
            out.append(f"unknown kv_layout {s.kv_layout!r}: choose sharded (caches split by sequence over a KV "
                       "head's ranks: long contexts) or replicated (NxDI's GQA copies: fewer collectives per decode "
                       "step) (--kv-layout)")
        if s.max_context_len > s.max_seq_len:
            out.append(f"max_context_len {s.max_context_len} exceeds max_seq_len {s.max_seq_len}: a prompt must fit "
                       "the cache (lower --max-context-len or raise --max-seq-len)")
        if min(s.tp, s.ep) >= 1:
            out += parallel.degree_problems(s.tp, s.ep)
        if s.backend == "reference":
            out += s._reference_problems()
        if neuron:
            out += s._neuron_problems(config)
        if config is not None and min(s.tp, s.ep) >= 1:
            out += s._layout_problems(config)
            out += chunk_problems(s.prefill_chunk, config, s.tp, neuron=neuron, max_context_len=s.max_context_len,
                                  max_seq_len=s.max_seq_len, kv_layout=s.kv_layout)
        elif s.prefill_chunk is not None and s.prefill_chunk < 1:
            out.append(f"prefill_chunk (--prefill-chunk) must be >= 1, got {s.prefill_chunk}")
        return out + s._draft_problems()

    def _draft_problems(self) -> list[str]:
        """Speculative decoding with an EAGLE3 draft: the reference backend in one process, the neuron backends with
        the drafter on the host or inside the graph (``fused_speculation``). The checkpoint itself is checked when it
        loads, against the model (``checkpoint.draft``)."""
        if not self.draft:
            return ([] if self.num_speculative_tokens is None else [
                "num_speculative_tokens (--speculative-tokens) applies with a draft: add --draft DIR"]) + \
                (["fused_speculation (--fused-speculation) needs a draft: add --draft DIR"]
                 if self.fused_speculation else [])
        out = []
        if self.num_speculative_tokens < 1:
            out.append(f"num_speculative_tokens (--speculative-tokens) must be >= 1, got {self.num_speculative_tokens}")
        if self.backend == "reference" and self.tp > 1:
            out.append(f"a draft with reference tp {self.tp}: not yet; speculate in one process (drop torchrun)")
        if self.fused_speculation:
            out += self._fused_problems()
        return out

    def _fused_problems(self) -> list[str]:
        """NxDI's fused speculation (the draft inside the graph, ``neuron.eagle``): on-device sampling (NxDI accepts
        on the device); prompts longer than ``prefill_chunk`` are prefilled in calls, the draft's too."""
        out = []
        if not _neuron(self.backend):
            out.append("fused_speculation (--fused-speculation) is NxDI's: use --backend neuron or neuron-cpu (the "
                       "reference speculates with its own drafter)")
            return out
        if not self.on_device_sampling:
            out.append("fused_speculation (--fused-speculation) accepts drafts on the device: add --on-device-sampling")
        if self.all_logits:
            out.append("fused_speculation returns token ids only: drop --all-logits")
        return out

    def validate(self, config: M3Config | None = None) -> "EngineSpec":
        """The resolved spec, or one :class:`ConfigError` listing every problem. ``config``: the model's, parsed
        once by the loader (the spec reads no file; without it the rules that need the model are skipped)."""
        problems = self.problems(config)
        if problems:
            raise SpecError(problems, source=f"engine spec (--backend {self.backend})")
        return self.resolve(config)

    def _reference_problems(self) -> list[str]:
        out = []
        for name in ("context_buckets", "token_buckets", "compiled", "continuous_batching", "all_logits"):
            if getattr(self, name) not in (None, False):
                out.append(f"{name} applies to the neuron backends only; drop it for --backend reference")
        if self.on_device_sampling:
            out.append("on_device_sampling applies to the neuron backend only")
        if self.weights != "bf16":
            out.append("weights fp8 applies to the neuron backends (the reference measures fp8 experts through "
                       "checkpoint.fp8_experts.fp8_twin_)")
        if self.lnc not in (None, 1):
            out.append("lnc applies to the neuron backend only")
        if self.decode_experts != "ep":
            out.append("decode_experts tp applies to the neuron backends (the reference's experts are one copy); "
                       "drop --decode-experts")
        if self.kv_layout != KV_LAYOUTS[0]:
            out.append(f"kv_layout {self.kv_layout} applies to the neuron backends (the reference keeps whole "
                       "caches per rank); drop --kv-layout")
        world = _world_size()
        if self.tp not in (None, world):
            out.append(f"reference tp {self.tp} must equal the number of processes (WORLD_SIZE {world}): run "
                       f"`torchrun --nproc-per-node {self.tp} ...`")
        if (self.device or "").startswith("cuda") and not _cuda_available():
            out.append(f"device {self.device!r} requested but no CUDA device is available; use --device cpu")
        return out

    def _neuron_problems(self, config: M3Config | None) -> list[str]:
        out = []
        if self.device not in (None, "cpu") and self.backend == "neuron-cpu" or \
                self.device is not None and self.backend == "neuron":
            out.append(f"--device {self.device} applies to the reference backend; the neuron backends run on "
                       "NeuronCores (neuron) or NxDI's CPU mode (neuron-cpu)")
        if self.lnc not in (1, 2):
            out.append(f"lnc must be 1 or 2 (trn2: 2), got {self.lnc}")
        if self.backend == "neuron-cpu" and self.ep != 1:
            out.append(f"ep {self.ep}: expert parallelism cannot run in NxDI's CPU mode; use ep 1")
        if self.backend == "neuron-cpu" and len(self.token_buckets or ()) > 1:
            out.append(f"token buckets {list(self.token_buckets)}: NxDI's CPU mode runs one decode module as long as "
                       "the cache (a shorter bucket's mask does not fit it); give one, --max-seq-len")
        if self.backend == "neuron-cpu" and self.compiled:
            out.append("compiled applies to --backend neuron (CPU mode compiles nothing)")
        if importlib.util.find_spec("neuronx_distributed_inference") is None:
            hint = ("set NXDI_SRC and NXD_SRC and run through the stand-ins (README, 'NxDI CPU mode')"
                    if self.backend == "neuron-cpu" else "install the Neuron SDK 2.29 (README, 'Install')")
            out.append(f"backend {self.backend} needs NxD Inference importable: {hint}")
        return out + bucket_problems(self.context_buckets, self.token_buckets, self.max_context_len,
                                     self.max_seq_len, config, self.prefill_chunk)

    def _layout_problems(self, c: M3Config) -> list[str]:
        out = parallel.model_problems(c, self.tp, self.ep, even_vocab=self.backend == "reference")
        if self.decode_experts == "tp":
            out += parallel.decode_experts_problems(c, self.tp)
        if self.max_seq_len > c.max_position_embeddings:
            out.append(f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                       f"{c.max_position_embeddings}")
        return out

    # ---- compiled artifacts -----------------------------------------------------------------------------------
    def artifact_key(self) -> dict:
        """What changes the NEFFs, as JSON-ready values (of the resolved spec)."""
        return {f: (list(v) if isinstance(v, tuple) else v) for f in ARTIFACT_FIELDS for v in [getattr(self, f)]}

    def artifact_dir(self, config: M3Config | None = None) -> str:
        """Where ``minimax-m3 compile`` writes this spec's NEFFs and where ``--backend neuron`` loads them:
        ``--compiled`` as given, else ``<model>/neuron-tp{tp}-ep{ep}-lnc{lnc}-{dtype}-b{batch}-s{seq}-{hash}``, the
        hash covering every field of :data:`ARTIFACT_FIELDS` (buckets, all-logits...)."""
        if self.compiled:
            return str(self.compiled)
        s = self.resolve(config)
        digest = hashlib.sha256(json.dumps(s.artifact_key(), sort_keys=True).encode()).hexdigest()[:10]
        dt = {"bfloat16": "bf16", "float32": "fp32"}.get(s.dtype, s.dtype)
        name = f"neuron-tp{s.tp}-ep{s.ep}-lnc{s.lnc}-{dt}-b{s.max_batch}-s{s.max_seq_len}-{digest}"
        return f"{str(self.model).rstrip('/')}/{name}"

    def write_artifact(self, path: str, for_vllm: bool = False) -> None:
        """Record in a compiled directory what it was compiled for (:data:`ARTIFACT_FILE`, written atomically);
        ``for_vllm``: vllm-neuron's neuron config (``compile --for-vllm``), which the engine does not load."""
        Path(path).mkdir(parents=True, exist_ok=True)
        record = {**self.artifact_key(), **({"for_vllm": True} if for_vllm else {})}
        write_atomic(Path(path) / ARTIFACT_FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")

    def check_artifact(self, path: str) -> None:
        """A compiled directory built for other options is refused, naming every field that differs (one without
        the record, e.g. compiled by hand, is taken as is)."""
        saved = Path(path) / ARTIFACT_FILE
        if not saved.is_file():
            return
        have, want = json.loads(saved.read_text()), self.artifact_key()
        if have.get("for_vllm"):
            raise SpecError(["compiled with --for-vllm (vllm-neuron's neuron config): serve it with `vllm serve` "
                             "(README, 'Serving with vLLM'), or compile again without --for-vllm"],
                            source=f"compiled artifact {path}")
        have = {**_RECORD_DEFAULTS, **have}
        diff = [f"{k}: compiled for {have.get(k)!r}, asked for {want[k]!r}" for k in want if have.get(k) != want[k]]
        if diff:
            raise SpecError(diff + ["compile again with these options, or pass the options it was compiled for"],
                            source=f"compiled artifact {path}")

    def to_json(self) -> dict:
        return {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}


def _call_tokens(config: M3Config) -> int:
    from ..ops.prefill import call_tokens  # torch: only where a reference spec is resolved against a model

    return call_tokens(config.index_block_size)


def _best_device() -> str:
    return "cuda" if _cuda_available() else "cpu"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# the older keyword names (NxDI-style) of load_engine(model, backend, **kw) -> EngineSpec fields
_KWARG_FIELDS = {"max_batch_size": "max_batch", "batch_size": "max_batch", "tp_degree": "tp", "moe_ep_degree": "ep",
                 "logical_nc_config": "lnc", "max_context_length": "max_context_len",
                 "context_encoding_buckets": "context_buckets", "token_generation_buckets": "token_buckets",
                 "compiled_path": "compiled", "prefill_all_logits": "all_logits"}


def spec_from_kwargs(model, backend: str = "reference", **kw) -> EngineSpec:
    """The spec of the keyword form ``load_engine(model, backend, **kw)`` (field names, or the older names such as
    ``max_batch_size``, ``tp_degree``, ``max_context_length``)."""
    fields = {_KWARG_FIELDS.get(k, k): (tuple(v) if isinstance(v, list) else v) for k, v in kw.items()}
    names = {f.name for f in dataclasses.fields(EngineSpec)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise SpecError([f"unknown engine option {k!r}" for k in unknown] + [f"known: {', '.join(sorted(names))}"])
    return EngineSpec(model=str(model), backend=backend, **fields)


# ---- the command-line options every engine command shares ----------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 128,256, got {text!r}") from None


def add_engine_options(p: argparse.ArgumentParser, *, backend: str | None = "reference",
                       model_required: bool = True) -> None:
    """The engine options of ``generate``, ``golden``, ``longbench``, ``compile`` (one set, one meaning);
    :func:`spec_from_args` turns them into an :class:`EngineSpec`. ``backend=None``: no ``--backend`` option."""
    g = p.add_argument_group("engine (see README, 'Engine spec')")
    g.add_argument("--model", required=model_required, help="checkpoint directory (or s3://bucket/prefix)")
    if backend is not None:
        g.add_argument("--backend", default=backend, choices=BACKENDS)
    g.add_argument("--device", default=None, help="reference: cpu | cuda | cuda:N (default: the best local device)")
    g.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default: bfloat16 on neuron and CUDA, float32 on CPU and in NxDI's CPU mode")
    g.add_argument("--max-seq-len", "--seq-len", dest="max_seq_len", type=int, default=4096,
                   help="prompt + generated tokens per sequence (neuron: the cache length)")
    g.add_argument("--max-context-len", type=int, default=None, help="longest prompt (default: --max-seq-len)")
    g.add_argument("--batch", "--max-batch", dest="max_batch", type=int, default=None,
                   help="sequences decoded together (default: 8 on reference, 1 on neuron)")
    g.add_argument("--tp", type=int, default=None, help="tensor parallel degree (neuron default 64; reference and "
                                                         "neuron-cpu: torchrun's WORLD_SIZE)")
    g.add_argument("--ep", type=int, default=None, help="expert parallel degree, dividing --tp (neuron default: "
                                                         "--tp; reference: $MINIMAX_M3_EP under torchrun, else 1)")
    g.add_argument("--lnc", type=int, default=None, help="neuron: logical NeuronCore config (trn2: 2)")
    g.add_argument("--context-buckets", type=_ints, default=None,
                   help="neuron prefill buckets, e.g. 1024,8192 (default: powers of two from 128 below "
                        "--max-context-len, and it)")
    g.add_argument("--token-buckets", type=_ints, default=None,
                   help="neuron decode buckets, multiples of the indexer block (default: block-aligned powers of two "
                        "from 128 below --max-seq-len, and it)")
    g.add_argument("--compiled", default=None,
                   help="neuron: the compiled artifact directory (default: under --model, named by these options)")
    g.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction, default=None,
                   help="neuron: one prefill per request into its own slot (default: on when --batch > 1)")
    g.add_argument("--all-logits", action=argparse.BooleanOptionalAction, default=None,
                   help="neuron: prefill returns every position's logits (a scoring build; default: on in CPU mode)")
    g.add_argument("--on-device-sampling", action="store_true", default=False,
                   help="neuron: sample on device (decode returns token ids)")
    g.add_argument("--weights", default=None, choices=WEIGHTS,
                   help="neuron: routed-expert format (fp8: NxD's expert-wise per-channel e4m3; default bf16)")
    g.add_argument("--decode-experts", default=None, choices=DECODE_EXPERTS,
                   help="neuron: how decode reads the routed experts. ep (default): the prefill's expert-parallel "
                        "shards, every local expert each step; tp: a second copy sharded over all --tp ranks, a step "
                        "reading only its tokens' experts' slices (more memory: `minimax-m3 plan --decode-experts "
                        "tp` says whether it fits)")
    g.add_argument("--kv-layout", default=None, choices=KV_LAYOUTS,
                   help="neuron: the KV caches' layout. sharded (default): each KV head's caches split by sequence "
                        "over its 16 ranks (1M tokens fit; 4 collectives per layer in decode); replicated: NxDI's "
                        "GQA copies, each rank holding its head's caches whole (2 collectives per layer, the "
                        "fastest decode at batch 1 where it fits: `minimax-m3 plan --layout replicated`)")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="tokens per prefill call: a longer prompt is prefilled in calls of N tokens, each attending to "
                        "the cache the earlier ones wrote; a multiple of the index block (neuron: of lcm(block, KV "
                        "group)). Default: reference 8192 in whole blocks; neuron the longest prompt rounded up to "
                        "whole units when at most 8192, else 8192 (the context buckets end at it)")
    g.add_argument("--draft", default=None, help="an EAGLE3 draft checkpoint (directory or s3://): speculative "
                                                   "decoding, reference backend (docs/speculative.md)")
    g.add_argument("--speculative-tokens", dest="num_speculative_tokens", type=int, default=None,
                   help="draft tokens verified per target forward with --draft (default 3)")
    g.add_argument("--fused-speculation", action="store_true", default=None,
                   help="neuron: run the draft inside the device graph (NxDI's fused EAGLE3 speculation; needs "
                        "--on-device-sampling); without it the draft runs on the host")


def spec_from_args(args: argparse.Namespace, **overrides) -> EngineSpec:
    """The :class:`EngineSpec` of :func:`add_engine_options`' options (``overrides`` win)."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineSpec) if hasattr(args, f.name)}
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if v is not None or k in ("model",)}
    return EngineSpec(**kw)
