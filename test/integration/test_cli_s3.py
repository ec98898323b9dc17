"""Commands take s3:// checkpoints and --upload s3:// destinations (moto's S3 server on loopback)."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from minimax_m3 import storage
from minimax_m3.cli import main as cli
from test.conftest import random_ids
from test.unit.test_storage import bucket, s3_server  # noqa: F401  (fixtures: moto server + fresh bucket)

MiB = 1 << 20


def upload_with_aws_tools(src, bucket, prefix, skip=()):  # noqa: F811
    """Like ``aws s3 cp --recursive``: boto3 ``upload_file`` per file, no manifest. Files over 1 MiB go
    multipart (one part), so their ETags end in ``-1`` and are not MD5s; the small ones' are."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    s3, cfg = boto3.client("s3"), TransferConfig(multipart_threshold=MiB, multipart_chunksize=8 * MiB)
    for p in sorted(src.rglob("*")):
        if p.is_file() and p.name not in skip:
            s3.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(src).as_posix()}", Config=cfg)
    return {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]}


def test_golden_from_s3_checkpoint_uploads_its_output(tiny_ckpt, bucket, tmp_path, capsys):  # noqa: F811
    storage.upload(tiny_ckpt, f"s3://{bucket}/ckpt/tiny", quiet=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": random_ids(40, seed=1)}) + "\n")
    local, remote = tmp_path / "local.safetensors", tmp_path / "remote.safetensors"
    assert cli(["golden", "--model", str(tiny_ckpt), "--prompts", str(prompts), "--out", str(local),
                "--decode-steps", "4", "--device", "cpu"]) == 0
    assert cli(["golden", "--model", f"s3://{bucket}/ckpt/tiny", "--prompts", str(prompts), "--out", str(remote),
                "--decode-steps", "4", "--device", "cpu", "--cache-dir", str(tmp_path / "cache"),
                "--upload", f"s3://{bucket}/golden/run1"]) == 0
    a, b = load_file(local), load_file(remote)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    back = storage.resolve(f"s3://{bucket}/golden/run1", tmp_path / "cache2", quiet=True)
    assert (back / "remote.safetensors").read_bytes() == remote.read_bytes()


def test_golden_from_a_prefix_uploaded_without_this_package(tiny_ckpt, bucket, tmp_path):  # noqa: F811
    etags = upload_with_aws_tools(tiny_ckpt, bucket, "aws-cp/tiny")
    assert etags["aws-cp/tiny/model-00001-of-00002.safetensors"].endswith('-1"')
    assert etags["aws-cp/tiny/config.json"] == f'"{hashlib.md5((tiny_ckpt / "config.json").read_bytes()).hexdigest()}"'
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": random_ids(40, seed=2)}) + "\n")
    local, remote = tmp_path / "local.safetensors", tmp_path / "remote.safetensors"
    common = ["--prompts", str(prompts), "--decode-steps", "4", "--device", "cpu"]
    assert cli(["golden", "--model", str(tiny_ckpt), "--out", str(local), *common]) == 0
    assert cli(["golden", "--model", f"s3://{bucket}/aws-cp/tiny", "--out", str(remote), *common,
                "--cache-dir", str(tmp_path / "cache")]) == 0
    a, b = load_file(local), load_file(remote)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prefix_missing_a_shard_is_refused_by_checkpoint_validation(tiny_ckpt, bucket, tmp_path, capsys):  # noqa: F811
    upload_with_aws_tools(tiny_ckpt, bucket, "partial/tiny", skip={"model-00002-of-00002.safetensors"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    rc = cli(["golden", "--model", f"s3://{bucket}/partial/tiny", "--prompts", str(prompts), "--device", "cpu",
              "--out", str(tmp_path / "g.safetensors"), "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2 and "model-00002-of-00002.safetensors" in err and "Traceback" not in err, err
    assert not (tmp_path / "g.safetensors").exists()


def test_missing_s3_checkpoint_is_one_clear_error(bucket, tmp_path, capsys):  # noqa: F811
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    rc = cli(["golden", "--model", f"s3://{bucket}/nothing-here", "--prompts", str(prompts),
              "--out", str(tmp_path / "g.safetensors"), "--cache-dir", str(tmp_path / "c")])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"s3://{bucket}/nothing-here" in err and not (tmp_path / "g.safetensors").exists()


@pytest.mark.parametrize("bad, needle", [
    ('{"input_ids": [1, 2]}\n{"ids": [3]}\n', "p.jsonl:2"),
    ('{"input_ids": "abc"}\n', "input_ids must be a list of integers"),
])
def test_malformed_prompts_file(tiny_ckpt, tmp_path, capsys, bad, needle):
    (tmp_path / "p.jsonl").write_text(bad)
    rc = cli(["golden", "--model", str(tiny_ckpt), "--prompts", str(tmp_path / "p.jsonl"),
              "--out", str(tmp_path / "g.safetensors")])
    assert rc == 2 and needle in capsys.readouterr().err


def test_longbench_reads_s3_model_and_uploads_its_report(bucket, tmp_path):  # noqa: F811
    from test.integration.test_longbench_e2e import MAX_LEN, MAXLEN, PROMPTS, rows

    from minimax_m3.checkpoint.synthetic import write_synthetic

    model = write_synthetic(tmp_path / "model", "tiny", seed=0)
    storage.upload(model, f"s3://{bucket}/models/tiny", quiet=True)
    lb = tmp_path / "LongBench"
    (lb / "config").mkdir(parents=True)
    (lb / "config" / "dataset2prompt.json").write_text(json.dumps(PROMPTS))
    (lb / "config" / "dataset2maxlen.json").write_text(json.dumps(MAXLEN))
    (lb / "data").mkdir()
    (lb / "data" / "trec.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows("trec")))
    out = tmp_path / "out"
    assert cli(["longbench", "--model", f"s3://{bucket}/models/tiny", "--data", str(lb / "data"), "--tasks", "trec",
                "--out", str(out), "--max-seq-len", str(MAX_LEN), "--device", "cpu", "--no-progress",
                "--cache-dir", str(tmp_path / "cache"), "--upload", f"s3://{bucket}/runs/trec"]) == 0
    back = storage.resolve(f"s3://{bucket}/runs/trec", tmp_path / "cache2", quiet=True)
    assert json.loads((back / "report.json").read_text()) == json.loads((out / "report.json").read_text())


def test_neuron_commands_without_the_sdk_say_what_to_install(tiny_ckpt, capsys):
    pytest.importorskip("minimax_m3.neuron")
    from minimax_m3.neuron import sdk_available

    if sdk_available():
        pytest.skip("the Neuron SDK is importable here")
    assert cli(["compile", "--synthetic"]) == 2
    assert "Neuron SDK 2.29" in capsys.readouterr().err
    assert cli(["generate", "--backend", "neuron", "--model", str(tiny_ckpt), "--prompt-ids", "1,2"]) == 2
    assert "neuronx-distributed-inference" in capsys.readouterr().err
