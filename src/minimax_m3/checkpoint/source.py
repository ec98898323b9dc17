"""A checkpoint seen through its format: release keys in, full-precision tensors out.

The format is read from ``quantization_config`` (config.json, or ModelOpt's ``hf_quant_config.json``) and checked
against the stored dtypes. Every stored tensor becomes part of one *logical* release tensor (the bf16 release's key):
``X.weight`` plus its companions ``X.weight_scale_inv`` (MXFP8) or ``X.weight_scale`` / ``X.weight_scale_2`` (NVFP4);
``X.input_scale`` is recorded as skipped (activation scale). Contradictions are collected in ``problems``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from . import formats as F
from .reader import DTYPE_NAMES, BufferPool, CheckpointError, CheckpointReader

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
COMPANIONS = (".weight_scale_inv", ".weight_scale_2", ".weight_scale", ".input_scale")


@dataclass(frozen=True)
class Format:
    kind: str  # bf16 | mxfp8 | nvfp4 (ModelOpt NVFP4 or MIXED_PRECISION)
    ignored: tuple[str, ...] = ()  # modules the config says stay unquantized
    algos: tuple[tuple[str, str], ...] = ()  # ModelOpt quantized_layers: (module pattern, algo)
    default_algo: str | None = None  # ModelOpt single-algorithm checkpoints

    def describe(self) -> str:
        return {"bf16": "bf16 (unquantized)", "mxfp8": "MXFP8 (e4m3 weights, E8M0 scale per 1x32)",
                "nvfp4": "NVFP4 mixed (ModelOpt: E2M1 routed experts per 16, the rest MXFP8)"}[self.kind]

    def listed_ignored(self, module: str) -> bool:
        return any(_module_match(module, p) for p in self.ignored)

    def algo_of(self, module: str) -> str | None:
        for pat, algo in self.algos:
            if _module_match(module, pat):
                return algo
        return None if self.listed_ignored(module) else self.default_algo


def _module_match(module: str, pattern: str) -> bool:
    """``pattern`` names ``module`` or one of its parents, as a dotted suffix path or with ``*`` wildcards."""
    if "*" in pattern:
        return re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), module) is not None or \
            re.match(re.escape(pattern).replace(r"\*", ".*") + r"\.", module) is not None
    return re.search(r"(^|\.)" + re.escape(pattern) + r"($|\.)", module) is not None


def detect_format(raw: dict, root: Path | None = None) -> tuple[Format, list[str]]:
    """The checkpoint format from its config (and ``hf_quant_config.json``); returns (format, problems)."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if qc is None and root is not None and (root / "hf_quant_config.json").is_file():
        try:
            hq = json.loads((root / "hf_quant_config.json").read_text())
            qc = {**hq.get("quantization", {}), "quant_method": "modelopt"}
        except (OSError, ValueError) as exc:
            return Format("bf16"), [f"hf_quant_config.json: unreadable ({exc})"]
    if qc is None:
        return Format("bf16"), []
    if not isinstance(qc, dict):
        return Format("bf16"), ["quantization_config is not an object"]
    method = qc.get("quant_method")
    if method == "mxfp8":
        problems = []
        if list(qc.get("weight_block_size", [1, 32])) != [1, 32]:
            problems.append(f"quantization_config.weight_block_size {qc.get('weight_block_size')} is not MXFP8's "
                            "[1, 32]")
        ignored = qc.get("ignored_layers", qc.get("modules_to_not_convert")) or []
        return Format("mxfp8", tuple(ignored)), problems
    if method == "modelopt":
        algo = qc.get("quant_algo")
        excluded = tuple(qc.get("exclude_modules") or ())
        if algo == "MIXED_PRECISION":
            layers = qc.get("quantized_layers") or {}
            pairs = tuple((m, str(v.get("quant_algo"))) for m, v in layers.items() if isinstance(v, dict))
            bad = sorted({a for _, a in pairs} - {"MXFP8", "NVFP4"})
            probs = [f"quantized_layers uses {bad}; supported per-layer algorithms are MXFP8 and NVFP4"] if bad else []
            return Format("nvfp4", excluded, pairs), probs
        if algo in ("NVFP4", "MXFP8"):
            return Format("nvfp4" if algo == "NVFP4" else "mxfp8", excluded, (), algo), []
        return Format("bf16"), [f"ModelOpt quant_algo {algo!r} is not supported; supported: MIXED_PRECISION, "
                                "NVFP4, MXFP8"]
    return Format("bf16"), [f"quant_method {method!r} is not supported; supported formats: bf16 (no "
                            "quantization_config), mxfp8, modelopt NVFP4 / MIXED_PRECISION"]


@dataclass(frozen=True)
class Logical:
    """One release tensor as the bf16 release would hold it."""

    key: str
    encoding: str  # plain | mxfp8 | nvfp4
    shape: tuple[int, ...]
    stored_dtype: torch.dtype  # of the main stored tensor
    files: tuple[str, ...]  # stored keys this tensor consumes (weight first)


class Source:
    """Format-aware view of a checkpoint: ``get(key)`` returns the release tensor ``key`` in full precision."""

    def __init__(self, reader: CheckpointReader, raw_config: dict, expected: dict | None = None):
        self.reader = reader
        self.format, self.problems = detect_format(raw_config, reader.root)
        self.logical: dict[str, Logical] = {}
        self.skipped_files: dict[str, str] = {}
        expected = expected or {}
        stored = set(reader.keys())
        for k in sorted(stored):
            if k.endswith(COMPANIONS):
                base = k.rsplit(".", 1)[0] + ".weight"
                if base not in stored:
                    self.problems.append(f"{k}: a scale without its weight {base}; the checkpoint is incomplete")
                elif k.endswith(".input_scale"):
                    self.skipped_files[k] = "NVFP4 activation (input) scale: used only by W4A4 kernels"
                continue
            self._add(k, stored, expected.get(k, (None,))[0])

    # ---- classification ---------------------------------------------------------------------------
    def _add(self, k: str, stored: set, want_shape) -> None:
        info = self.reader.info(k)
        module = k[: -len(".weight")] if k.endswith(".weight") else k
        fmt, dt = self.format, info.dtype
        has = {c: module + c in stored for c in COMPANIONS}
        name = DTYPE_NAMES.get(dt, str(dt))
        if has[".weight_scale_inv"]:
            enc, files = "mxfp8", (k, module + ".weight_scale_inv")
        elif has[".weight_scale"] or has[".weight_scale_2"]:
            enc, files = "nvfp4", (k, module + ".weight_scale", module + ".weight_scale_2")
        else:
            enc, files = "plain", (k,)
        problems = self.problems
        if enc == "plain" and dt not in FLOATS:
            problems.append(f"{k}: stored as {name} with no scale tensor; a {fmt.kind} checkpoint needs bf16/fp16/fp32 "
                            "here (or the weight_scale(_inv) companion is missing)")
        if enc != "plain":
            if fmt.kind == "bf16":
                problems.append(f"{k}: stored quantized ({enc}) but config.json has no quantization_config; restore "
                                "the quantization_config of the release")
            elif fmt.listed_ignored(module) and not fmt.algos:
                problems.append(f"{k}: ignored_layers lists {module} as unquantized, but it is stored {enc}")
            elif fmt.kind == "mxfp8" and enc == "nvfp4":
                problems.append(f"{k}: NVFP4 scales in an MXFP8 checkpoint")
            elif fmt.algos or fmt.default_algo:
                algo = fmt.algo_of(module)
                if algo is None:
                    problems.append(f"{k}: stored {enc} but quantization_config does not list {module}")
                elif algo.lower() != enc:
                    problems.append(f"{k}: quantization_config says {algo} but the tensors are {enc}")
        elif fmt.algos and dt in FLOATS and (algo := fmt.algo_of(module)) is not None:
            problems.append(f"{k}: quantization_config lists {module} as {algo} but it is stored {name} without "
                            "scales")
        shape = tuple(info.shape)
        if enc == "mxfp8":
            sinfo = self.reader.info(files[1])
            if dt != torch.float8_e4m3fn:
                problems.append(f"{k}: MXFP8 weight stored as {name}, expected F8_E4M3")
            if sinfo.dtype != torch.uint8:
                problems.append(f"{files[1]}: E8M0 scale stored as {DTYPE_NAMES.get(sinfo.dtype)}, expected U8")
            if tuple(sinfo.shape) != F.mxfp8_scale_shape(shape):
                problems.append(f"{files[1]}: shape {list(sinfo.shape)} does not fit weight {list(shape)}; expected "
                                f"{list(F.mxfp8_scale_shape(shape))} (one scale per 32 inputs)")
        elif enc == "nvfp4":
            missing = [f for f in files[1:] if f not in stored]
            if missing:
                problems.append(f"{k}: NVFP4 weight lacks {missing}; the checkpoint is incomplete")
            if len(shape) != 2:
                problems.append(f"{k}: NVFP4 weight must be 2-D, got {list(shape)}")
            else:
                n_in = want_shape[1] if want_shape and len(want_shape) == 2 else shape[1] * 2
                shape = (shape[0], n_in)
                wp, ws = F.nvfp4_shapes(shape)
                if dt != torch.uint8:
                    problems.append(f"{k}: NVFP4 packed weight stored as {name}, expected U8")
                if tuple(info.shape) != wp:
                    problems.append(f"{k}: packed shape {list(info.shape)} does not hold {list(shape)}; expected "
                                    f"{list(wp)} (two E2M1 per byte)")
                if not missing:
                    si, s2 = self.reader.info(files[1]), self.reader.info(files[2])
                    if si.dtype != torch.float8_e4m3fn or tuple(si.shape) != ws:
                        problems.append(f"{files[1]}: {DTYPE_NAMES.get(si.dtype)}{list(si.shape)}, expected "
                                        f"F8_E4M3{list(ws)} (one scale per 16 inputs)")
                    if s2.dtype != torch.float32 or len(s2.shape) > 1 or (s2.shape and s2.shape[0] != 1):
                        problems.append(f"{files[2]}: {DTYPE_NAMES.get(s2.dtype)}{list(s2.shape)}, expected a F32 "
                                        "scalar")
        self.logical[k] = Logical(k, enc, shape, dt, files)

    # ---- access -----------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.logical)

    def __contains__(self, key: str) -> bool:
        return key in self.logical

    def shape(self, key: str) -> list[int]:
        return list(self.logical[key].shape)

    def out_dtype(self, key: str) -> torch.dtype:
        """The dtype a full-precision read returns: float32 for quantized tensors, else as stored."""
        lg = self.logical[key]
        return torch.float32 if lg.encoding != "plain" else lg.stored_dtype

    def get(self, key: str, dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
            pool: BufferPool | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The release tensor ``key``: dequantized (float32 unless ``dtype``) or as stored (cast to ``dtype``).

        ``rows=(r0, r1)`` gives only those rows (dim 0). ``out`` (contiguous, ``dtype``, the result's size) receives
        the result; ``pool`` supplies recycled memory for the result and for stored bytes that are only an
        intermediate (they are given back to it)."""
        if key not in self.logical:
            raise KeyError(f"tensor {key!r} is not in the checkpoint at {self.reader.root}")
        lg = self.logical[key]
        r = self.reader
        want = dtype or self.out_dtype(key)
        shape = lg.shape if rows is None else (rows[1] - rows[0], *lg.shape[1:])
        if out is None and pool is not None:
            n = 1
            for d in shape:
                n *= d
            if n * want.itemsize >= (1 << 20):
                out = pool.take(n * want.itemsize).view(want).view(shape)
        if lg.encoding == "mxfp8":
            q = r.get(lg.files[0], pool=pool, rows=rows)
            t = F.mxfp8_dequantize(q, r.get(lg.files[1], rows=rows), want, key, out)
            if pool is not None:
                pool.give(q)
            return t
        if lg.encoding == "nvfp4":
            t = F.nvfp4_dequantize(r.get(lg.files[0], rows=rows), r.get(lg.files[1], rows=rows),
                                   r.get(lg.files[2]).reshape(()), lg.shape[1], want, key)
            return t if out is None else out.copy_(t.view(out.shape))
        if out is not None and want == lg.stored_dtype:
            return r.get(key, out=out, rows=rows)
        t = r.get(key, pool=pool, rows=rows)
        if out is not None:
            out.copy_(t.view(out.shape))
            if pool is not None:
                pool.give(t)
            return out
        return t if t.dtype == want else t.to(want)

    def nbytes(self, key: str) -> int:
        return sum(self.reader.info(f).nbytes for f in self.logical[key].files)

    def check_scales(self) -> list[str]:
        """Read every scale tensor (a few % of the bytes) and report NaN codes: E8M0 255, NaN E4M3, bad scale_2."""
        out = []
        for lg in self.logical.values():
            try:
                out.extend(self._check_one(lg))
            except (CheckpointError, KeyError):  # unreadable data: already reported as a file-level problem
                continue
        return out

    def _check_one(self, lg: Logical) -> list[str]:
        out = []
        if lg.encoding == "mxfp8":
            s = self.reader.get(lg.files[1])
            if s.dtype == torch.uint8 and s.numel() and int(s.max()) == 255 and (n := int((s == 255).sum())):
                out.append(f"{lg.files[1]}: {n} E8M0 scale(s) are 255 (NaN); the shard is corrupt, re-download it")
        elif lg.encoding == "nvfp4" and all(f in self.reader for f in lg.files):
            s = self.reader.get(lg.files[1])
            if s.dtype == torch.float8_e4m3fn and (n := int(torch.isnan(s.float()).sum())):
                out.append(f"{lg.files[1]}: {n} NaN E4M3 scale(s); the shard is corrupt, re-download it")
            s2 = self.reader.get(lg.files[2])
            if s2.dtype == torch.float32 and s2.numel() == 1 and not (0 < float(s2) < float("inf")):
                out.append(f"{lg.files[2]}: weight_scale_2 is {float(s2)}; must be finite and > 0")
        return out
