"""``neuron.rank_files``'s file writing and unit grouping, without the Neuron SDK (its NxD part is tested in
``test/neuron_cpu/test_presharded.py``). Oracle: safetensors' own loader reads back what was written."""

import pytest
import torch
from safetensors.torch import load_file

from minimax_m3.checkpoint.mapping import unit_of
from minimax_m3.neuron.rank_files import RankFile, units


def test_units_group_the_stream_by_layer():
    names = ["embed_tokens.weight", "norm.weight", "layers.0.a", "layers.0.b", "layers.1.a", "layers.10.a",
             "layers.10.b", "lm_head.weight"]
    got = [(u, list(p)) for u, p in units((n, torch.zeros(1)) for n in names)]
    assert got == [(None, names[:2]), (0, names[2:4]), (1, names[4:5]), (10, names[5:7]), (None, names[7:])]
    assert unit_of("layers.x.weight") is None and unit_of("layers.3") is None


def test_one_unit_rule_for_release_and_converted_keys():
    assert unit_of("language_model.model.layers.12.self_attn.q_proj.weight") == unit_of("layers.12.attn.q") == 12
    assert unit_of("language_model.model.embed_tokens.weight") is None and unit_of("lm_head.weight") is None
    assert unit_of("vision_tower.encoder.layers.3.mlp.fc1.weight") is None  # vision: not a decoder layer
    assert unit_of("mtp.layers.0.norm.weight") is None


def test_rank_file_round_trips_through_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
               "b.rank": torch.arange(4, dtype=torch.int32),
               "c.norm": torch.randn(7, generator=g), "d.flag": torch.tensor([True, False]),
               "e.idx": torch.tensor([2, 3], dtype=torch.int64), "f.scalar": torch.tensor(1.5)}
    f = RankFile(tmp_path / "tp0_sharded_checkpoint.safetensors", reserve=4096)
    for k, t in tensors.items():
        f.add(k, t.t() if t.dim() == 2 else t)  # a non-contiguous view is written in its logical order
    f.close()
    back = load_file(str(tmp_path / "tp0_sharded_checkpoint.safetensors"))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        want = t.t() if t.dim() == 2 else t
        assert back[k].dtype == want.dtype and torch.equal(back[k], want), k
    assert not (tmp_path / "tp0_sharded_checkpoint.safetensors.partial").exists()


def test_header_overflow_and_abort_leave_no_file(tmp_path):
    f = RankFile(tmp_path / "tp1.safetensors", reserve=16)
    f.add("x" * 64, torch.zeros(2))
    with pytest.raises(RuntimeError, match="exceeds the 16 reserved"):
        f.close()
    assert list(tmp_path.iterdir()) == []
    f = RankFile(tmp_path / "tp2.safetensors", reserve=1024)
    f.add("y", torch.zeros(2))
    with pytest.raises(ValueError, match="written twice"):
        f.add("y", torch.zeros(2))
    f.abort()
    assert list(tmp_path.iterdir()) == []
