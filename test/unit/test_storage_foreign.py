"""Prefixes written by ordinary tools (boto3 ``upload_file``, as ``aws s3 sync``/``cp`` do): no manifest.

Same moto S3 server on loopback as ``test_storage.py``. The oracles are hashlib over the source files
and the ETags S3 (moto) computed on upload: a single-part ETag is the MD5 of the bytes, a multipart one
ends in ``-N`` and is not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from test.unit.test_storage import (  # noqa: F401  (fixtures: moto server + fresh bucket)
    DOWN, SERIAL, UP, Recorder, assert_same_tree, bucket, files_of, make_checkpoint, s3_server,
)

import boto3  # noqa: E402  (test_storage skips the module without boto3/moto)
from botocore.exceptions import EndpointConnectionError  # noqa: E402

from minimax_m3 import storage  # noqa: E402
from minimax_m3.storage import MANIFEST_NAME, STAGING_NAME, UPLOADING_NAME  # noqa: E402

SHARD = "model-00001-of-00002.safetensors"  # 6 MiB: multipart with UP's 5 MiB parts


def upload_plain(src: Path, bucket: str, prefix: str) -> dict[str, str]:  # noqa: F811  (the imported fixture)
    """What users do: boto3's ``upload_file`` per file, no manifest. Returns relative path -> ETag."""
    s3 = boto3.client("s3")
    for p in sorted(src.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(src).as_posix()}", Config=UP)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]
    return {o["Key"][len(prefix) + 1:]: o["ETag"] for o in listed}


def rot_in_store(bucket: str, key: str) -> None:  # noqa: F811  (the imported fixture)
    """Flip one byte of a stored object inside moto; its ETag (computed at upload) stays, as on S3."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    obj = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, key)
    etag, data = obj.etag, bytearray(obj.value)
    data[len(data) // 2] ^= 0xFF
    obj.value = bytes(data)
    assert obj.etag == etag


def test_foreign_prefix_loads_verified_and_cached(bucket, tmp_path):  # noqa: F811  (the imported fixture)
    src = make_checkpoint(tmp_path / "ckpt")
    etags = upload_plain(src, bucket, "hf/m3")
    boto3.client("s3").put_object(Bucket=bucket, Key="hf/m3/empty-folder/", Body=b"")  # console "folder"
    want = {rel: data for rel, data in files_of(src).items()}
    assert etags[SHARD].endswith('-2"')  # multipart: not an MD5
    assert all(etags[r] == f'"{hashlib.md5(d).hexdigest()}"' for r, d in want.items() if r != SHARD)

    uri = f"s3://{bucket}/hf/m3"
    rec = Recorder()
    got = storage.resolve(uri, tmp_path / "cache", quiet=True, client=rec.client)
    assert_same_tree(src, got)
    assert not (got / "empty-folder").exists()
    assert [o for o, _, _ in rec.calls[:2]] == ["GetObject", "ListObjectsV2"] and not rec.keys("HeadObject")
    fetched = sorted(k for k in rec.keys("GetObject") if not k.endswith(MANIFEST_NAME))
    assert fetched == sorted(f"hf/m3/{r}" for r in want)
    local = json.loads((got / MANIFEST_NAME).read_text())
    assert local["source"] == "s3-listing" and local["total_bytes"] == sum(map(len, want.values()))
    assert {f["path"]: (f["size"], f["sha256"], f["etag"]) for f in local["files"]} == \
        {r: (len(d), hashlib.sha256(d).hexdigest(), etags[r]) for r, d in want.items()}
    assert storage.is_complete(got, rehash=True)

    # Later runs: one listing, no GET, files untouched.
    mtimes = {p: p.stat().st_mtime_ns for p in got.rglob("*") if p.is_file()}
    rec = Recorder()
    assert storage.resolve(uri, tmp_path / "cache", quiet=True, client=rec.client) == got
    assert [o for o, _, _ in rec.calls] == ["ListObjectsV2"]
    assert mtimes == {p: p.stat().st_mtime_ns for p in got.rglob("*") if p.is_file()}

    # One object replaced with other tools: only it is fetched again.
    (src / "config.json").write_text(json.dumps({"model_type": "minimax_m3", "hidden_size": 128}))
    upload_plain(src, bucket, "hf/m3")
    rec = Recorder()
    storage.resolve(uri, tmp_path / "cache", quiet=True, client=rec.client)
    assert rec.keys("GetObject") == ["hf/m3/config.json"]
    assert_same_tree(src, got)

    # The prefix later gets this package's manifest: the manifest now rules (no file fetched again).
    storage.upload(src, uri, quiet=True, config=UP)
    rec = Recorder()
    storage.resolve(uri, tmp_path / "cache", quiet=True, client=rec.client)
    assert rec.keys("GetObject") == [f"hf/m3/{MANIFEST_NAME}"]
    assert (got / MANIFEST_NAME).read_bytes() == storage.manifest_bytes(storage.build_manifest(src))


def test_md5_of_a_plain_etag_refuses_a_damaged_object(bucket, tmp_path, monkeypatch):  # noqa: F811  (the imported fixture)
    # botocore's own CRC check of whole-object GETs is turned off: older uploads carry no CRC.
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    src = make_checkpoint(tmp_path / "ckpt")
    upload_plain(src, bucket, "rot")
    rot_in_store(bucket, "rot/model-00002-of-00002.safetensors")
    dest = tmp_path / "dl"
    with pytest.raises(storage.IntegrityError, match=r"s3://\S+/rot/model-00002-of-00002.safetensors: the "
                                                     r"downloaded bytes' MD5 [0-9a-f]{32} does not match the "
                                                     r"object's ETag .*aws s3 cp"):
        storage.download(f"s3://{bucket}/rot", dest, quiet=True, config=SERIAL)
    assert not (dest / "model-00002-of-00002.safetensors").exists() and not (dest / MANIFEST_NAME).exists()
    assert [p.name for p in (dest / STAGING_NAME).rglob("*") if p.is_file()] == ["verified.jsonl"]


def test_kms_etag_is_not_taken_for_an_md5(bucket, tmp_path):  # noqa: F811  (the imported fixture)
    """Real S3 gives SSE-KMS objects an ETag that is not the bytes' MD5 (moto does not): the listing is
    rewritten as S3 would answer, and only the object that HEAD reports as aws:kms is accepted."""
    s3 = boto3.client("s3")
    s3.put_object(Bucket=bucket, Key="kms/a.bin", Body=b"a" * 1000, ServerSideEncryption="aws:kms")
    s3.put_object(Bucket=bucket, Key="kms/b.bin", Body=b"b" * 1000)

    def opaque_etags(parsed, **kwargs):
        for o in parsed.get("Contents", []):
            o["ETag"] = '"0123456789abcdef0123456789abcdef"'

    rec = Recorder()
    rec.client.meta.events.register("after-call.s3.ListObjectsV2", opaque_etags)
    with pytest.raises(storage.IntegrityError, match=r"kms/b.bin: the downloaded bytes' MD5"):
        storage.download(f"s3://{bucket}/kms", tmp_path / "dl", quiet=True, client=rec.client, config=SERIAL)
    assert (tmp_path / "dl" / "a.bin").read_bytes() == b"a" * 1000
    assert sorted(rec.keys("HeadObject")) == ["kms/a.bin", "kms/b.bin"]


def test_interrupted_foreign_download_resumes(bucket, tmp_path):  # noqa: F811  (the imported fixture)
    src = make_checkpoint(tmp_path / "ckpt")
    upload_plain(src, bucket, "ck")
    uri, dest = f"s3://{bucket}/ck", tmp_path / "dl"

    def die(op, params, n):  # the network goes away in the middle of the multipart shard
        if op == "GetObject" and params["Key"].endswith(SHARD) and params.get("Range", "").startswith("bytes=3"):
            raise EndpointConnectionError(endpoint_url="http://simulated")

    with pytest.raises(storage.TransferInterruptedError, match="re-run the same command to resume"):
        storage.download(uri, dest, quiet=True, client=Recorder(die).client, config=SERIAL)
    kept = {rel for rel in files_of(src) if (dest / rel).exists()}
    assert kept and SHARD not in kept and not (dest / MANIFEST_NAME).exists()
    victim = sorted(kept)[0]  # damaged in place (same size, new mtime): its MD5 no longer matches the ETag
    (dest / victim).write_bytes(b"x" * (dest / victim).stat().st_size)
    rec = Recorder()
    storage.download(uri, dest, quiet=True, client=rec.client, config=DOWN)
    assert {k.removeprefix("ck/") for k in rec.keys("GetObject")} - {MANIFEST_NAME} == \
        (set(files_of(src)) - kept) | {victim}
    assert_same_tree(src, dest)


def test_interrupted_own_upload_is_refused_and_resumes(bucket, tmp_path):  # noqa: F811  (the imported fixture)
    src = make_checkpoint(tmp_path / "ckpt")
    uri = f"s3://{bucket}/own"

    def die(op, params, n):  # interrupted in the middle of the data, long before the manifest
        if op == "UploadPart" and params.get("PartNumber") == 2:
            raise EndpointConnectionError(endpoint_url="http://simulated")

    with pytest.raises(storage.TransferInterruptedError):
        storage.upload(src, uri, quiet=True, client=Recorder(die).client, config=UP)
    listed = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="own/")["Contents"]}
    assert f"own/{UPLOADING_NAME}" in listed and f"own/{MANIFEST_NAME}" not in listed
    with pytest.raises(storage.IncompleteUploadError, match=rf"{uri}: {UPLOADING_NAME} is here but no "
                                                            rf"{MANIFEST_NAME}: its upload is incomplete.*aws s3 rm"):
        storage.resolve(uri, tmp_path / "cache", quiet=True)
    assert not (tmp_path / "cache").exists()

    present = {k.removeprefix("own/") for k in listed} - {UPLOADING_NAME}
    assert present and SHARD not in present  # some files made it, the shard did not

    rec = Recorder()  # the re-run sends the marker, only the missing files, the manifest; then drops the marker
    storage.upload(src, uri, quiet=True, client=rec.client, config=UP)
    sent = [k.removeprefix("own/") for o, k, _ in rec.calls if o in ("PutObject", "CreateMultipartUpload")]
    assert sent[0] == UPLOADING_NAME and sent[-1] == MANIFEST_NAME
    assert sorted(sent[1:-1]) == sorted(set(files_of(src)) - present)
    assert rec.calls[-1][:2] == ("DeleteObject", f"own/{UPLOADING_NAME}")
    assert_same_tree(src, storage.resolve(uri, tmp_path / "cache", quiet=True))


def test_listing_errors_name_the_problem(bucket, tmp_path):  # noqa: F811  (the imported fixture)
    s3 = boto3.client("s3")
    s3.put_object(Bucket=bucket, Key="dirs/a/", Body=b"")
    with pytest.raises(storage.ObjectNotFoundError, match=r"dirs: the prefix holds only folder placeholders"):
        storage.resolve(f"s3://{bucket}/dirs", tmp_path / "c", quiet=True)
    s3.put_object(Bucket=bucket, Key="clash/w", Body=b"1")
    s3.put_object(Bucket=bucket, Key="clash/w/x", Body=b"2")
    with pytest.raises(storage.IntegrityError, match=r"clash/w: this key is both an object and a folder"):
        storage.resolve(f"s3://{bucket}/clash", tmp_path / "c", quiet=True)
    assert not (tmp_path / "c").exists()
