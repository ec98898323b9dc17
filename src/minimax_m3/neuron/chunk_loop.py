"""The chunk loop: a prefill wider than ``prefill_chunk`` as successive context-encoding calls of the NxDI
application, each writing its chunk at its first position and attending to what the earlier calls wrote, merged into
what one call returns (the engine's provider and vllm-neuron, which hands the model whole prompts, both go through the
application's ``forward``: ``model.NeuronMiniMaxM3ForCausalLM.forward``)."""

from __future__ import annotations

import torch


def prefill_in_chunks(app, forward, kw: dict):
    """``forward(**kw)`` (NxDI's), or for a prefill wider than ``prefill_chunk`` C: successive calls on the slices
    ``[:, p0:p0+C]`` of ``input_ids`` / ``attention_mask`` (given, or inferred by the application's ``forward``) /
    ``position_ids``, each writing its chunk into the rows' cache lines at ``p0`` and attending to what the earlier
    calls wrote, returning what one call over the whole prompt returns: per row the last-token logits or token ids
    from the call holding its last real token (right padding), all-position logits concatenated
    (``prefill_all_logits``). After the first call every column, padding included, is at position ``p0 + i`` (the
    cache manager writes a chunk from its first position; a row already complete writes only past its end), and a
    last call 1 token (or ``speculation_length`` tokens) wide is sent wider so NxDI routes it to context encoding."""
    chunk, ids, pos = app.neuron_config.prefill_chunk, kw.get("input_ids"), kw.get("position_ids")
    if not chunk or ids is None or pos is None or ids.shape[-1] <= chunk or not app._is_prefill(pos):
        return forward(**kw)
    mask = kw["attention_mask"]  # the application's forward infers one where none is given (vllm-neuron)
    b, n = ids.shape
    holder = (mask.sum(dim=1).clamp(min=1) - 1) // chunk  # the call holding each row's last real token
    outs, widths = [], []
    for p0 in range(0, n, chunk):
        w = min(chunk, n - p0)
        part = {**kw, "input_ids": ids[:, p0:p0 + w], "attention_mask": mask[:, p0:p0 + w],
                "position_ids": pos[:, p0:p0 + w]}
        wide = w
        while p0 and wide in (1, app.neuron_config.speculation_length):  # NxDI would route it to token generation
            wide += 1
        if p0:
            part["position_ids"] = (p0 + torch.arange(wide, dtype=pos.dtype)).expand(b, -1).contiguous()
        if wide > w:
            part["input_ids"] = torch.nn.functional.pad(part["input_ids"], (0, wide - w), value=app.config.pad_token_id)
            part["attention_mask"] = torch.nn.functional.pad(part["attention_mask"], (0, wide - w))
        outs.append(forward(**part))
        widths.append(w)
    return _merge(outs, widths, holder, app.neuron_config.prefill_all_logits)


def _merge(outs, widths, holder, all_positions: bool):
    """The outputs of a chunked prefill's calls as one call's (see :func:`prefill_in_chunks`): each of ``logits``,
    ``tokens``, ``hidden_states`` (NxDI may hand the same tensor under several names) concatenated over the calls'
    widths when it holds every position, else row ``r`` taken from call ``holder[r]``; fused speculation's four
    outputs row by row the same way."""
    out, merged = outs[-1], {}
    fields = {name: [getattr(o, name, None) for o in outs] for name in ("logits", "tokens", "hidden_states")}
    for name, values in fields.items():
        if not all(torch.is_tensor(v) for v in values):
            continue
        same = next((m for m in merged if all(a is b for a, b in zip(fields[m], values))), None)
        if same is not None:
            merged[name] = merged[same]
        elif all_positions and name != "tokens" and values[0].dim() > 2:
            merged[name] = torch.cat([v[:, :w] for v, w in zip(values, widths)], dim=1)
        else:
            merged[name] = _by_row(values, holder)
    fused = [getattr(o, "fused_outputs", None) for o in outs]  # fused speculation: NxDI's four outputs, per row
    if all(isinstance(f, (list, tuple)) for f in fused):
        picked = [_by_row(values, holder) for values in zip(*fused)]
        same = getattr(out, "hidden_states", None) is out.fused_outputs  # NxDI hands the list under both names
        merged["fused_outputs"] = picked
        if same:
            merged["hidden_states"] = picked
    states = [getattr(o, "aux_states", None) for o in outs]  # a draft's target states: every position
    if all(torch.is_tensor(v) for v in states):
        merged["aux_states"] = torch.cat([v[:, :w] for v, w in zip(states, widths)], dim=1)
    for name, value in merged.items():
        setattr(out, name, value)
    return out


def _by_row(values, holder):
    """Row ``r`` of ``values[holder[r]]`` (one tensor per call, rows first)."""
    picked = values[-1].clone()
    for k, v in enumerate(values[:-1]):
        picked[holder == k] = v[holder == k]
    return picked
