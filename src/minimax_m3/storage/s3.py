"""The boto3 half of :mod:`minimax_m3.storage`: client, error translation, verified parallel transfers.

Imported only when an ``s3://`` URI is used. Transfers go through s3transfer's ``TransferManager``
(parallel multipart uploads and ranged-GET downloads, its own retries of broken streams) on a client
with botocore's retry config (``adaptive`` mode, 10 attempts, overridable by ``AWS_RETRY_MODE`` /
``AWS_MAX_ATTEMPTS``), so throttling (SlowDown, 503) and transient errors back off and retry.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

try:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    from s3transfer.exceptions import RetriesExceededError
    from s3transfer.manager import TransferManager
    from s3transfer.subscribers import BaseSubscriber
except ImportError as e:  # pragma: no cover - exercised only without the s3 extra
    from .manifest import StorageError

    raise StorageError(f"s3:// URIs need boto3 ({e}); install it: pip install 'minimax-m3-neuron[s3]'") from None
from tqdm import tqdm

from .._atomic import move_into_place
from .manifest import (
    _INTERNAL, MANIFEST_NAME, UPLOADING_NAME, AccessDeniedError, BucketNotFoundError, IncompleteUploadError,
    IntegrityError, Journal, ObjectNotFoundError, StorageError, TransferInterruptedError, _hash_workers, etag_md5,
    file_digests, unsafe_path,
)

MiB = 1 << 20
_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "InvalidAccessKeyId",
           "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "AccountProblem"}
_NO_KEY = {"NoSuchKey", "404", "NotFound"}


def make_client() -> Any:
    """An S3 client from boto3's standard chain (profile, env, instance role; ``AWS_ENDPOINT_URL_S3``)."""
    retries = {"mode": os.environ.get("AWS_RETRY_MODE", "adaptive"),
               "total_max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", "10"))}
    cfg = Config(retries=retries, max_pool_connections=max(10, _concurrency() + 4),
                 connect_timeout=20, read_timeout=120)
    return boto3.session.Session().client("s3", config=cfg)


def _concurrency() -> int:
    return int(os.environ.get("MINIMAX_M3_S3_CONCURRENCY", "16"))


def transfer_config() -> TransferConfig:
    """64 MiB parts, 16 parallel requests (``MINIMAX_M3_S3_CONCURRENCY``), 5 attempts per stream."""
    return TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB,
                          max_concurrency=_concurrency(), num_download_attempts=5)


def key_of(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def translate(e: BaseException, uri: str, action: str) -> StorageError:
    """One :class:`StorageError` naming the URI and the fix for a botocore/s3transfer failure."""
    if isinstance(e, StorageError):
        return e
    if isinstance(e, NoCredentialsError):
        return AccessDeniedError(f"{action} on {uri}: no AWS credentials found; configure them (aws configure, "
                                 "AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an instance role)")
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        bucket = uri[5:].split("/", 1)[0]
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{uri}: bucket '{bucket}' does not exist at this endpoint; create it "
                                       f"(aws s3 mb s3://{bucket}) or fix the URI / AWS_ENDPOINT_URL_S3")
        if code in _DENIED:
            return AccessDeniedError(
                f"{action} on {uri}: access denied ({code}); check which identity you use "
                "(aws sts get-caller-identity) and that its policy allows s3:GetObject, s3:PutObject and "
                f"s3:ListBucket on '{bucket}' (S3 also answers AccessDenied for a missing key without s3:ListBucket)")
        if code in _NO_KEY:
            return ObjectNotFoundError(f"{uri}: no such object; check the URI (aws s3 ls {uri})")
        return TransferInterruptedError(f"{action} on {uri} failed after retries ({code}: {e}); "
                                        "re-run the same command to resume (raise AWS_MAX_ATTEMPTS if it is throttled)")
    if isinstance(e, (BotoCoreError, RetriesExceededError)):
        return TransferInterruptedError(f"{action} on {uri} failed after retries ({type(e).__name__}: {e}); check "
                                        "the network / AWS_ENDPOINT_URL_S3 and re-run the same command to resume")
    raise e


@contextlib.contextmanager
def translating(uri: str, action: str) -> Iterator[None]:
    try:
        yield
    except (ClientError, BotoCoreError, RetriesExceededError) as e:
        raise translate(e, uri, action) from e


class _Progress(BaseSubscriber):
    """Feeds s3transfer's byte counts into one shared tqdm bar (thread-safe)."""

    def __init__(self, bar: tqdm, lock: threading.Lock, size: int | None = None, etag: str | None = None):
        self.bar, self.lock, self.size, self.etag = bar, lock, size, etag

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        if self.size is not None and self.etag is not None:  # from the listing: no HEAD per file, and
            future.meta.provide_transfer_size(self.size)     # ranged GETs carry If-Match: etag
            future.meta.provide_object_etag(self.etag)

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        with self.lock:
            self.bar.update(bytes_transferred)


def _bar(total: int, desc: str, quiet: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=quiet, mininterval=0.5, dynamic_ncols=True)


def list_objects(client: Any, bucket: str, prefix: str, uri: str) -> dict[str, tuple[int, str]]:
    """Relative path -> (size, etag) of every object under the prefix."""
    root = f"{prefix}/" if prefix else ""
    out: dict[str, tuple[int, str]] = {}
    with translating(uri, "s3:ListBucket"):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(root):]] = (obj["Size"], obj.get("ETag"))
    return out


def get_object(client: Any, bucket: str, key: str, uri: str) -> bytes:
    with translating(uri, "s3:GetObject"):
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def head_bucket(client: Any, bucket: str, uri: str) -> None:
    try:
        with translating(uri, "s3:HeadBucket"):
            client.head_bucket(Bucket=bucket)
    except ObjectNotFoundError:  # HeadBucket answers a bare 404 for a missing bucket
        raise BucketNotFoundError(f"{uri}: bucket '{bucket}' does not exist at this endpoint; create it "
                                  f"(aws s3 mb s3://{bucket}) or fix the URI / AWS_ENDPOINT_URL_S3") from None


def listing_files(objects: dict[str, tuple[int, str]], uri: str) -> list[dict[str, Any]]:
    """Manifest-like entries (path, size, etag and, for a plain ETag, its md5) for a prefix without a manifest.

    Folder placeholders (keys ending in ``/``) and this package's local bookkeeping names are skipped; a key
    that cannot be a file under a directory is refused.
    """
    files = []
    for rel, (size, etag) in sorted(objects.items()):
        if rel.endswith("/") or rel.split("/", 1)[0] in _INTERNAL:
            continue
        if why := unsafe_path(rel):
            raise IntegrityError(f"{uri.rstrip('/')}/{rel}: this key cannot be a local file ({why}); rename or delete "
                                 "the object (aws s3 mv / aws s3 rm) and try again")
        f = {"path": rel, "size": size, "etag": etag}
        if md5 := etag_md5(etag):
            f["md5"] = md5
        files.append(f)
    parents = {"/".join(f["path"].split("/")[:i]) for f in files for i in range(1, f["path"].count("/") + 1)}
    if clash := sorted(parents & {f["path"] for f in files}):
        raise IntegrityError(f"{uri.rstrip('/')}/{clash[0]}: this key is both an object and a folder of other "
                             "objects, which a local directory cannot hold; rename or delete one of them")
    return files


def remote_state(client: Any, bucket: str, prefix: str, uri: str, *,
                 list_first: bool = False) -> tuple[bytes | None, list[dict[str, Any]] | None]:
    """What the prefix holds: ``(manifest bytes, None)`` after a finished upload by this package, or
    ``(None, listing_files(...))`` for a prefix written by other tools (``aws s3 sync``, boto3, ...).

    One GET of the manifest when it exists (``list_first=False``), one paginated listing for a prefix
    without one (``list_first=True``: what the cache saw last time). Refuses a prefix holding this
    package's upload-in-progress marker and no manifest, and an empty prefix.
    """
    manifest_key = key_of(prefix, MANIFEST_NAME)
    if not list_first:
        try:
            return get_object(client, bucket, manifest_key, uri), None
        except ObjectNotFoundError:
            pass
    objects = list_objects(client, bucket, prefix, uri)
    if MANIFEST_NAME in objects:
        return get_object(client, bucket, manifest_key, uri), None
    if UPLOADING_NAME in objects:
        raise IncompleteUploadError(
            f"{uri}: {UPLOADING_NAME} is here but no {MANIFEST_NAME}: its upload is incomplete (interrupted or still "
            "running); re-run the upload (minimax_m3.storage.upload or the command's --upload) and try again. If the "
            f"prefix was since filled by other tools, delete the marker: aws s3 rm {uri.rstrip('/')}/{UPLOADING_NAME}")
    files = listing_files(objects, uri)
    if files:
        return None, files
    if objects:
        raise ObjectNotFoundError(f"{uri}: the prefix holds only folder placeholders (keys ending in '/'), no files; "
                                  f"check the URI (aws s3 ls --recursive {uri.rstrip('/')}/)")
    raise ObjectNotFoundError(f"{uri}: nothing under this prefix; check the URI (aws s3 ls {uri.rstrip('/')}/) "
                              "or upload the directory first with --upload")


def _kms_encrypted(client: Any, bucket: str, key: str, uri: str) -> bool:
    """True when S3 encrypted the object with KMS: its plain-looking ETag is then no MD5 of the bytes."""
    with translating(uri, "s3:GetObject"):
        head = client.head_object(Bucket=bucket, Key=key)
    return str(head.get("ServerSideEncryption", "")).startswith("aws:kms")


def _place(f: dict[str, Any], tmp: Path, dest: Path, uri: str, journal: Journal, client: Any, key: str,
           bucket: str) -> None:
    """Check a downloaded temporary file against its manifest entry (size, sha256) or its listing entry
    (size, the MD5 of a plain ETag), then rename it into place."""
    src, size = f"{uri.rstrip('/')}/{f['path']}", tmp.stat().st_size
    sha, md5 = file_digests(tmp, md5="md5" in f) if size == f["size"] else ("(not computed)", None)
    bad = None
    if "sha256" in f and (size != f["size"] or sha != f["sha256"]):
        bad = (f"downloaded bytes do not match the manifest (size {size} vs {f['size']}, sha256 {sha} vs "
               f"{f['sha256']}): the object was changed or corrupted after upload; re-upload the directory")
    elif size != f["size"]:
        bad = (f"downloaded {size} bytes but the listing says {f['size']}: the object changed during the download; "
               "re-run the same command")
    elif "md5" in f and md5 != f["md5"] and not _kms_encrypted(client, bucket, key, uri):
        bad = (f"the downloaded bytes' MD5 {md5} does not match the object's ETag {f['etag']}: the stored object is "
               "damaged or the bytes were corrupted on the way; re-run to download it again, and if it fails again "
               f"upload that file anew (aws s3 cp FILE {src})")
    if bad:
        tmp.unlink(missing_ok=True)
        raise IntegrityError(f"{src}: {bad}")
    final = move_into_place(tmp, dest / f["path"])
    journal.add(final, f, sha)


def fetch_verified(client: Any, bucket: str, prefix: str, uri: str, dest: Path, staging: Path,
                   files: list[dict[str, Any]], journal: Journal, *, quiet: bool, config: Any = None) -> None:
    """Download ``files`` into ``staging`` in parallel; verify and rename each into ``dest``.

    Entries with a sha256 come from a manifest, and the store's listing must still show their sizes;
    entries with an etag come from that listing itself.
    """
    todo = journal.missing(dest, files)
    if not todo:
        return
    if all("etag" in f and "sha256" not in f for f in files):
        objects = {f["path"]: (f["size"], f["etag"]) for f in files}
    else:
        objects = list_objects(client, bucket, prefix, uri)
    sizes = {rel: size for rel, (size, _) in objects.items()}
    for f in todo:
        if sizes.get(f["path"]) != f["size"]:
            raise IntegrityError(
                f"{uri.rstrip('/')}/{f['path']}: the manifest lists {f['size']} bytes but the store has "
                f"{'no such object' if f['path'] not in sizes else str(sizes[f['path']]) + ' bytes'}: the prefix "
                "was changed after its upload; re-upload the directory")
    lock, total = threading.Lock(), sum(f["size"] for f in todo)
    done = sum(f["size"] for f in files) - total
    with _bar(total, f"download {uri} ({done >> 20} MiB already here)", quiet) as bar, \
            translating(uri, "s3:GetObject"), ThreadPoolExecutor(_hash_workers()) as hashers, \
            TransferManager(client, config or transfer_config()) as tm:
        jobs = []
        for f in todo:
            tmp, key = staging / f["path"], key_of(prefix, f["path"])
            tmp.parent.mkdir(parents=True, exist_ok=True)
            fut = tm.download(bucket, key, str(tmp), subscribers=[_Progress(bar, lock, *objects[f["path"]])])
            jobs.append((f, tmp, key, fut))
        checks = []
        try:
            for f, tmp, key, fut in jobs:
                fut.result()
                checks.append(hashers.submit(_place, f, tmp, dest, uri, journal, client, key, bucket))
                for c in checks:
                    if c.done():
                        c.result()  # fail early on a corrupted object
            for c in checks:
                c.result()
        except BaseException:
            hashers.shutdown(wait=True, cancel_futures=True)
            raise


def put_verified(client: Any, bucket: str, prefix: str, uri: str, root: Path, man: dict[str, Any], *,
                 quiet: bool, config: Any = None) -> None:
    """Mark the prefix as being uploaded, withdraw its manifest, then upload every manifest file not
    already stored with the same size and sha256 metadata."""
    existing = {rel: size for rel, (size, _) in list_objects(client, bucket, prefix, uri).items()}
    marker = {"format": "minimax-m3-upload/1", "files": len(man["files"]), "total_bytes": man["total_bytes"]}
    with translating(uri, "s3:PutObject"):
        client.put_object(Bucket=bucket, Key=key_of(prefix, UPLOADING_NAME), Body=json.dumps(marker).encode(),
                          ContentType="application/json")
    if MANIFEST_NAME in existing:  # the prefix reads as incomplete until the new manifest is written
        with translating(uri, "s3:DeleteObject"):
            client.delete_object(Bucket=bucket, Key=key_of(prefix, MANIFEST_NAME))
    todo = []
    for f in man["files"]:
        if existing.get(f["path"]) == f["size"]:
            with translating(uri, "s3:GetObject"):
                meta = client.head_object(Bucket=bucket, Key=key_of(prefix, f["path"])).get("Metadata", {})
            if meta.get("sha256") == f["sha256"]:
                continue
        todo.append(f)
    lock = threading.Lock()
    with _bar(sum(f["size"] for f in todo), f"upload {uri}", quiet) as bar, translating(uri, "s3:PutObject"), \
            TransferManager(client, config or transfer_config()) as tm:
        futs = [tm.upload(str(root / f["path"]), bucket, key_of(prefix, f["path"]),
                          extra_args={"Metadata": {"sha256": f["sha256"]}},
                          subscribers=[_Progress(bar, lock)]) for f in todo]
        for fut in futs:
            fut.result()


def put_manifest(client: Any, bucket: str, prefix: str, uri: str, data: bytes) -> None:
    """Write the manifest (the upload is complete from here on), then remove the in-progress marker.

    A marker left next to a manifest (the delete failed) is harmless: the manifest wins.
    """
    with translating(uri, "s3:PutObject"):
        client.put_object(Bucket=bucket, Key=key_of(prefix, MANIFEST_NAME), Body=data,
                          ContentType="application/json")
    with translating(uri, "s3:DeleteObject"):
        client.delete_object(Bucket=bucket, Key=key_of(prefix, UPLOADING_NAME))
