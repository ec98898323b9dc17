"""minimax_m3.storage against a real S3 protocol server (moto's standalone server on loopback).

Every S3 call goes through boto3's real HTTP path; the endpoint reaches boto3 only through the
``AWS_ENDPOINT_URL`` environment variable, as it would for an S3-compatible store in production.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import uuid
from pathlib import Path
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed: pip install -e '.[s3]'")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install -e '.[s3-test]'")

import boto3  # noqa: E402
from boto3.s3.transfer import TransferConfig  # noqa: E402
from botocore.exceptions import EndpointConnectionError  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from minimax_m3 import storage  # noqa: E402
from minimax_m3.storage import MANIFEST_NAME, STAGING_NAME  # noqa: E402

MiB = 1 << 20
# Small parts so a few-MiB file really goes multipart both ways (S3's minimum upload part is 5 MiB).
UP = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4)
DOWN = TransferConfig(multipart_threshold=1 * MiB, multipart_chunksize=1 * MiB, max_concurrency=4)
SERIAL = TransferConfig(multipart_threshold=1 * MiB, multipart_chunksize=1 * MiB, max_concurrency=1)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A moto S3/IAM server on 127.0.0.1 (free port), reached through AWS_ENDPOINT_URL."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "MINIMAX_M3_CACHE": str(tmp_path_factory.mktemp("cache"))}
    with mock.patch.dict(os.environ, env):
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
            os.environ.pop(k, None)
        yield url
    server.stop()


class Recorder:
    """An S3 client that records (operation, key, range) of each API call; ``fail`` may raise instead."""

    def __init__(self, fail=None):
        from minimax_m3.storage import s3 as _s3

        self.client, self.calls, self.fail, self.lock = _s3.make_client(), [], fail, threading.Lock()
        self.client.meta.events.register("before-parameter-build.s3", self._hook)

    def _hook(self, params, model, **kwargs):
        with self.lock:
            self.calls.append((model.name, params.get("Key"), params.get("Range")))
            n = len(self.calls)
        if self.fail is not None:
            self.fail(model.name, params, n)

    def keys(self, op):
        return [k for o, k, _ in self.calls if o == op]


@pytest.fixture
def bucket(s3_server):
    name = f"m3-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def make_checkpoint(root: Path) -> Path:
    """A small safetensors checkpoint: two shards (one > 5 MiB, so multipart), config and index."""
    g = torch.Generator().manual_seed(0)
    shards = {"model-00001-of-00002.safetensors": {"a.weight": torch.randn(1536, 1024, generator=g)},
              "model-00002-of-00002.safetensors": {"b.weight": torch.randn(64, 32, generator=g).bfloat16(),
                                                    "b.bias": torch.arange(7, dtype=torch.int64)}}
    root.mkdir(parents=True)
    for name, tensors in shards.items():
        save_file(tensors, root / name)
    (root / "config.json").write_text(json.dumps({"model_type": "minimax_m3", "hidden_size": 64}))
    index = {"metadata": {}, "weight_map": {k: n for n, t in shards.items() for k in t}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def make_compiled(root: Path) -> Path:
    """A fake NxDI compiled directory: neuron_config.json, model.pt and pre-sharded weights."""
    (root / "weights").mkdir(parents=True)
    (root / "neuron_config.json").write_text(json.dumps({"tp_degree": 2, "batch_size": 1}))
    torch.save({"neff": os.urandom(3 * MiB)}, root / "model.pt")
    for r in range(2):
        save_file({"w": torch.full((256, 256), float(r))}, root / "weights" / f"tp{r}_sharded_checkpoint.safetensors")
    (root / "weights" / "empty marker ü.txt").write_bytes(b"")  # edge cases: 0 bytes, space, non-ASCII key
    return root


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_tree(src: Path, got: Path) -> None:
    """Byte-identical files; besides them only the manifest and the (empty) lock file."""
    want, have = files_of(src), files_of(got)
    assert set(have) == set(want) | {MANIFEST_NAME, storage.LOCK_NAME}
    for rel, data in want.items():
        assert have[rel] == data, rel
    assert not (got / STAGING_NAME).exists()


# ------------------------------------------------------------------------------ no server needed


def test_uri_parsing_and_cache_path(tmp_path, monkeypatch):
    assert storage.is_s3("s3://b/p") and not storage.is_s3("/data/s3:/x") and not storage.is_s3(tmp_path)
    assert storage.parse_s3_uri("s3://bkt/a/b/") == ("bkt", "a/b")
    assert storage.parse_s3_uri("s3://bkt") == ("bkt", "")
    for bad in ("s3://", "s3:///key", "s3://b/*.json", "/local/dir"):
        with pytest.raises(storage.InvalidURIError, match="s3://bucket/prefix"):
            storage.parse_s3_uri(bad)
    monkeypatch.setenv("MINIMAX_M3_CACHE", str(tmp_path / "c"))
    assert storage.cache_path("s3://bkt/a/b/") == tmp_path / "c" / "bkt" / "a" / "b"
    assert storage.cache_path("s3://bkt/x", tmp_path / "o") == tmp_path / "o" / "bkt" / "x"
    monkeypatch.delenv("MINIMAX_M3_CACHE")
    assert storage.default_cache_dir() == Path.home() / ".cache" / "minimax-m3" / "s3"


def test_local_paths_need_no_s3(tmp_path):
    ck = make_compiled(tmp_path / "c")
    assert storage.resolve(ck) == ck and storage.resolve(str(ck)) == ck
    assert storage.read_bytes(ck / "neuron_config.json") == (ck / "neuron_config.json").read_bytes()
    with pytest.raises(storage.ObjectNotFoundError, match="does not exist"):
        storage.resolve(tmp_path / "missing")


def test_manifest_hashes_and_rejects_unsafe_entries(tmp_path):
    ck = make_compiled(tmp_path / "c")
    man = storage.build_manifest(ck)
    import hashlib

    want = {p: (len(b), hashlib.sha256(b).hexdigest()) for p, b in files_of(ck).items()}
    assert {f["path"]: (f["size"], f["sha256"]) for f in man["files"]} == want
    assert man["total_bytes"] == sum(s for s, _ in want.values())
    for path in ("../evil", "/etc/passwd", MANIFEST_NAME):
        bad = dict(man, files=[{"path": path, "size": 1, "sha256": "0" * 64}])
        with pytest.raises(storage.IntegrityError, match="invalid manifest"):
            storage.parse_manifest(storage.manifest_bytes(bad), "x")


# ---------------------------------------------------------------------------- round trips


def test_checkpoint_round_trip_is_byte_identical_and_multipart(bucket, tmp_path):
    src = make_checkpoint(tmp_path / "ckpt")
    uri = f"s3://{bucket}/release/bf16"
    rec = Recorder()
    man = storage.upload(src, uri, quiet=True, client=rec.client, config=UP)
    assert rec.keys("CreateMultipartUpload") == ["release/bf16/model-00001-of-00002.safetensors"]
    assert len(rec.keys("UploadPart")) == 2  # 6 MiB shard in 5 MiB parts
    marker = f"release/bf16/{storage.UPLOADING_NAME}"  # first write: the prefix reads as our unfinished upload
    writes = [(o, k) for o, k, _ in rec.calls if o in ("PutObject", "CreateMultipartUpload", "DeleteObject")]
    assert writes[0] == ("PutObject", marker)
    assert writes[-2:] == [("PutObject", f"release/bf16/{MANIFEST_NAME}"), ("DeleteObject", marker)]  # manifest last
    assert len(man["files"]) == 4

    rec = Recorder()
    got = storage.download(uri, tmp_path / "dl", quiet=True, client=rec.client, config=DOWN)
    assert_same_tree(src, got)
    ranges = [r for o, k, r in rec.calls if o == "GetObject" and k.endswith("00001-of-00002.safetensors")]
    size = (src / "model-00001-of-00002.safetensors").stat().st_size
    assert size > 6 * MiB and len(ranges) == -(-size // MiB)  # ranged GETs of 1 MiB, run in parallel
    assert all(r.startswith("bytes=") for r in ranges) and not rec.keys("HeadObject")  # sizes from the listing
    a = load_file(got / "model-00001-of-00002.safetensors")["a.weight"]
    assert torch.equal(a, load_file(src / "model-00001-of-00002.safetensors")["a.weight"])


def test_compiled_round_trip_through_resolve_and_cache(bucket, tmp_path, capfd):
    src = make_compiled(tmp_path / "compiled")
    uri = f"s3://{bucket}/neff/tp2/"
    storage.upload(src, uri, config=UP)  # progress bar on
    got = storage.resolve(uri)
    assert got == Path(os.environ["MINIMAX_M3_CACHE"]) / bucket / "neff" / "tp2"
    assert_same_tree(src, got)
    err = capfd.readouterr().err
    assert f"upload {uri}" in err and f"download {uri}" in err and "B/s" in err
    assert storage.read_text(f"{uri}neuron_config.json") == (src / "neuron_config.json").read_text()

    # Second resolve: one GET (the manifest), files untouched.
    mtimes = {p: p.stat().st_mtime_ns for p in got.rglob("*") if p.is_file()}
    rec = Recorder()
    assert storage.resolve(uri, quiet=True, client=rec.client) == got
    assert [o for o, _, _ in rec.calls] == ["GetObject"] and rec.calls[0][1].endswith(MANIFEST_NAME)
    assert mtimes == {p: p.stat().st_mtime_ns for p in got.rglob("*") if p.is_file()}

    # The remote copy changes: only the changed file is fetched again; the cache follows.
    torch.save({"neff": b"recompiled"}, src / "model.pt")
    rec = Recorder()
    storage.upload(src, uri, quiet=True, client=rec.client, config=UP)
    assert [k for k in rec.keys("PutObject") + rec.keys("CreateMultipartUpload")] == \
        [f"neff/tp2/{storage.UPLOADING_NAME}", "neff/tp2/model.pt", f"neff/tp2/{MANIFEST_NAME}"]  # unchanged skipped
    rec = Recorder()
    assert storage.resolve(uri, quiet=True, client=rec.client, rehash=True) == got
    assert set(rec.keys("GetObject")) == {f"neff/tp2/{MANIFEST_NAME}", "neff/tp2/model.pt"}
    assert_same_tree(src, got)


def test_concurrent_resolves_download_once(bucket, tmp_path):
    src = make_compiled(tmp_path / "c")
    uri = f"s3://{bucket}/shared"
    storage.upload(src, uri, quiet=True)
    recs, out = [Recorder(), Recorder()], []
    threads = [threading.Thread(target=lambda r=r: out.append(storage.resolve(uri, tmp_path / "cache", quiet=True,
                                                                                client=r.client))) for r in recs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(out) == 2 and out[0] == out[1]
    data_gets = [k for r in recs for k in r.keys("GetObject") if not k.endswith(MANIFEST_NAME)]
    assert sorted(set(data_gets)) == sorted(f"shared/{p}" for p in files_of(src))
    assert len([k for k in data_gets if k.endswith("neuron_config.json")]) == 1
    assert_same_tree(src, out[0])


# --------------------------------------------------------------------- interruption and damage


def test_interrupted_download_resumes_and_keeps_only_verified_files(bucket, tmp_path):
    src = make_checkpoint(tmp_path / "ckpt")
    uri = f"s3://{bucket}/ck"
    storage.upload(src, uri, quiet=True, config=UP)
    dest = tmp_path / "dl"

    def die(op, params, n):  # the network goes away in the middle of the 6 MiB shard
        if (op == "GetObject" and params["Key"].endswith("00001-of-00002.safetensors")
                and params.get("Range", "").startswith("bytes=3")):
            raise EndpointConnectionError(endpoint_url="http://simulated")

    with pytest.raises(storage.TransferInterruptedError, match="re-run the same command to resume"):
        storage.download(uri, dest, quiet=True, client=Recorder(die).client, config=SERIAL)
    assert not (dest / MANIFEST_NAME).exists()
    assert not (dest / "model-00001-of-00002.safetensors").exists()
    staged = [p for p in (dest / STAGING_NAME).rglob("*") if p.is_file()]
    assert [p.name for p in staged] == ["verified.jsonl"]  # no partial file left behind
    kept = {rel for rel in files_of(src) if (dest / rel).exists()}
    assert kept and all((dest / rel).read_bytes() == (src / rel).read_bytes() for rel in kept)

    # A kept file damaged in place (same size, new mtime) is not trusted: re-hashed and fetched again.
    victim = sorted(kept)[0]
    (dest / victim).write_bytes(b"x" * (dest / victim).stat().st_size)
    rec = Recorder()
    storage.download(uri, dest, quiet=True, client=rec.client, config=SERIAL)
    fetched = {k.removeprefix("ck/") for k in rec.keys("GetObject")} - {MANIFEST_NAME}
    assert fetched == (set(files_of(src)) - kept) | {victim}
    assert_same_tree(src, dest)


def test_corrupted_object_is_detected_and_nothing_partial_lands(bucket, tmp_path):
    src = make_compiled(tmp_path / "c")
    uri = f"s3://{bucket}/bad"
    storage.upload(src, uri, quiet=True)
    s3 = boto3.client("s3")
    n = (src / "weights/tp1_sharded_checkpoint.safetensors").stat().st_size
    s3.put_object(Bucket=bucket, Key="bad/weights/tp1_sharded_checkpoint.safetensors", Body=b"\0" * n)
    dest = tmp_path / "dl"
    with pytest.raises(storage.IntegrityError, match=r"tp1_sharded_checkpoint.safetensors: downloaded bytes do not "
                                                     r"match the manifest .*re-upload"):
        storage.download(uri, dest, quiet=True, config=SERIAL)
    assert not (dest / "weights/tp1_sharded_checkpoint.safetensors").exists()
    assert not (dest / MANIFEST_NAME).exists()
    assert [p.name for p in (dest / STAGING_NAME).rglob("*") if p.is_file()] == ["verified.jsonl"]

    # A size change is caught from the listing, before any byte is downloaded.
    s3.put_object(Bucket=bucket, Key="bad/model.pt", Body=b"short")
    rec = Recorder()
    with pytest.raises(storage.IntegrityError, match=r"bad/model.pt: the manifest lists \d+ bytes but the store has 5"):
        storage.download(uri, tmp_path / "dl2", quiet=True, client=rec.client)
    assert rec.keys("GetObject") == [f"bad/{MANIFEST_NAME}"]
    assert not (tmp_path / "dl2" / "model.pt").exists()


def test_upload_interrupted_before_manifest_is_refused_then_resumed(bucket, tmp_path):
    src = make_checkpoint(tmp_path / "ckpt")
    uri = f"s3://{bucket}/half"

    def die(op, params, n):
        if op == "PutObject" and params["Key"].endswith(MANIFEST_NAME):
            raise EndpointConnectionError(endpoint_url="http://simulated")

    with pytest.raises(storage.TransferInterruptedError):
        storage.upload(src, uri, quiet=True, client=Recorder(die).client, config=UP)
    with pytest.raises(storage.IncompleteUploadError, match=rf"{uri}: .*no {MANIFEST_NAME}: its upload is incomplete"):
        storage.resolve(uri, tmp_path / "cache", quiet=True)
    assert not (tmp_path / "cache").exists()  # nothing written for a refused download

    rec = Recorder()  # re-running the upload sends only the marker and the manifest
    storage.upload(src, uri, quiet=True, client=rec.client, config=UP)
    assert [(o, k) for o, k, _ in rec.calls if o in ("PutObject", "UploadPart")] == \
        [("PutObject", f"half/{storage.UPLOADING_NAME}"), ("PutObject", f"half/{MANIFEST_NAME}")]
    assert_same_tree(src, storage.resolve(uri, tmp_path / "cache", quiet=True))

    # Re-uploading new content over a complete prefix withdraws the old manifest first.
    (src / "config.json").write_text("{}")
    with pytest.raises(storage.TransferInterruptedError):
        storage.upload(src, uri, quiet=True, client=Recorder(die).client, config=UP)
    with pytest.raises(storage.IncompleteUploadError):
        storage.download(uri, tmp_path / "dl", quiet=True)


# ------------------------------------------------------------------------------ error messages


def test_missing_bucket_and_missing_prefix(bucket, tmp_path):
    with pytest.raises(storage.BucketNotFoundError, match=r"s3://no-such-bkt-5/x.*does not exist.*aws s3 mb"):
        storage.resolve("s3://no-such-bkt-5/x", tmp_path / "c", quiet=True)
    with pytest.raises(storage.ObjectNotFoundError, match=rf"s3://{bucket}/nothing/here: nothing under this prefix"):
        storage.resolve(f"s3://{bucket}/nothing/here", tmp_path / "c", quiet=True)
    with pytest.raises(storage.ObjectNotFoundError, match="no such object"):
        storage.read_bytes(f"s3://{bucket}/nothing.json")
    with pytest.raises(storage.BucketNotFoundError, match="no-such-bkt-5"):
        storage.upload(make_compiled(tmp_path / "c1"), "s3://no-such-bkt-5/x", quiet=True)
    with pytest.raises(storage.BucketNotFoundError, match="no-such-bkt-5"):
        storage.check_upload_target("s3://no-such-bkt-5/x")
    storage.check_upload_target(f"s3://{bucket}/x")
    assert not (tmp_path / "c").exists()


def test_access_denied_from_iam_policy(s3_server, bucket, tmp_path):
    """moto's IAM enforcement (enabled through /moto-api/reset-auth) answers a real AccessDenied."""
    import urllib.request

    storage.upload(make_compiled(tmp_path / "c"), f"s3://{bucket}/p", quiet=True)
    iam = boto3.client("iam")
    user = f"reader-{uuid.uuid4().hex[:6]}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="only-list", PolicyDocument=json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:ListAllMyBuckets", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    client = boto3.client("s3", aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])

    def auth(count: str):
        urllib.request.urlopen(urllib.request.Request(f"{s3_server}/moto-api/reset-auth", data=count.encode(),
                                                      headers={"Content-Type": "text/plain"}, method="POST")).read()

    auth("0")
    try:
        with pytest.raises(storage.AccessDeniedError, match=rf"s3:GetObject on s3://{bucket}/p: access denied "
                                                            r"\(AccessDenied\).*sts get-caller-identity"):
            storage.resolve(f"s3://{bucket}/p", tmp_path / "cache", quiet=True, client=client)
        with pytest.raises(storage.AccessDeniedError, match=rf"s3://{bucket}/q: access denied"):
            storage.upload(tmp_path / "c", f"s3://{bucket}/q", quiet=True, client=client)
    finally:
        auth("inf")
    assert not (tmp_path / "cache").exists()


def test_no_credentials_is_one_clear_error(bucket, tmp_path, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(storage.AccessDeniedError, match="no AWS credentials found"):
        storage.resolve(f"s3://{bucket}/p", tmp_path / "cache", quiet=True)


def test_throttling_is_retried_with_backoff(bucket, tmp_path, monkeypatch):
    """Two 503 SlowDown answers are retried by botocore; with AWS_MAX_ATTEMPTS=1 it is one clear error."""
    from botocore.awsrequest import AWSResponse

    src = make_compiled(tmp_path / "c")
    uri = f"s3://{bucket}/t"
    storage.upload(src, uri, quiet=True)

    class Raw:
        def stream(self, **kw):
            yield b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    def throttled(times):
        rec, left = Recorder(), [times]

        def send(request, **kw):
            if "neuron_config.json" in request.url and left[0] > 0:
                left[0] -= 1
                return AWSResponse(request.url, 503, {}, Raw())

        rec.client.meta.events.register("before-send.s3.GetObject", send)
        return rec, left

    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    rec, left = throttled(2)
    assert_same_tree(src, storage.download(uri, tmp_path / "dl", quiet=True, client=rec.client))
    assert left == [0]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    rec, left = throttled(1)
    assert rec.client.meta.config.retries["total_max_attempts"] == 1
    with pytest.raises(storage.TransferInterruptedError, match=r"SlowDown.*AWS_MAX_ATTEMPTS"):
        storage.download(uri, tmp_path / "dl2", quiet=True, client=rec.client)


# ---------------------------------------------------------------------------------- CLI helpers


def test_cli_helpers(bucket, tmp_path, capsys):
    parser = storage.add_storage_args(argparse.ArgumentParser(prog="minimax-m3 compile"))
    ns = parser.parse_args(["--upload", f"s3://{bucket}/out", "--cache-dir", str(tmp_path)])
    assert (ns.upload, ns.cache_dir) == (f"s3://{bucket}/out", str(tmp_path))
    assert parser.parse_args([]).upload is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--upload", "/local/dir"])
    assert "argument --upload: '/local/dir' is not an S3 URI; write it as s3://bucket/prefix" in capsys.readouterr().err

    src = make_compiled(tmp_path / "c")
    assert storage.maybe_upload(src, None) is None
    man = storage.maybe_upload(src, f"s3://{bucket}/out", quiet=True)
    assert man == storage.build_manifest(src)
    assert_same_tree(src, storage.resolve(f"s3://{bucket}/out", ns.cache_dir, quiet=True))
