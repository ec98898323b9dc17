"""The boto3 half of :mod:`minimax_m3.storage`: client, error translation, verified parallel transfers.

Imported only when an ``s3://`` URI is used. Transfers go through s3transfer's ``TransferManager``
(parallel multipart uploads and ranged-GET downloads, its own retries of broken streams) on a client
with botocore's retry config (``adaptive`` mode, 10 attempts, overridable by ``AWS_RETRY_MODE`` /
``AWS_MAX_ATTEMPTS``), so throttling (SlowDown, 503) and transient errors back off and retry.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
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
    from .storage import StorageError

    raise StorageError(f"s3:// URIs need boto3 ({e}); install it: pip install 'minimax-m3-neuron[s3]'") from None
from tqdm import tqdm

from .storage import (
    MANIFEST_NAME, AccessDeniedError, BucketNotFoundError, IncompleteUploadError, IntegrityError,
    ObjectNotFoundError, StorageError, TransferInterruptedError, _hash_workers, sha256_file,
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
        return AccessDeniedError(f"{action} on {uri}: no AWS credentials found; configure them "
                                 "(aws configure, AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an instance role)")
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


class DirLock:
    """An exclusive ``flock`` so concurrent processes (e.g. every rank of a job) fill a cache once."""

    def __init__(self, path: Path):
        self.path, self._fd = path, None

    def __enter__(self) -> "DirLock":
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


class Journal:
    """Files already verified and renamed into place, with their (size, mtime_ns) at that moment.

    A file whose stat still matches is trusted on resume without re-hashing; one that is present with
    the right size but unrecorded is re-hashed; anything else is downloaded again.
    """

    def __init__(self, path: Path):
        self.path, self._lock, self.entries = path, threading.Lock(), {}
        if path.is_file():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    e = json.loads(line)
                    self.entries[e["path"]] = (e["size"], e["sha256"], e["mtime_ns"])

    def add(self, final: Path, f: dict[str, Any]) -> None:
        st = final.stat()
        line = json.dumps({"path": f["path"], "size": st.st_size, "sha256": f["sha256"], "mtime_ns": st.st_mtime_ns})
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(line + "\n")
            self.entries[f["path"]] = (st.st_size, f["sha256"], st.st_mtime_ns)

    def holds(self, dest: Path, f: dict[str, Any]) -> bool:
        final = dest / f["path"]
        try:
            st = final.stat()
        except FileNotFoundError:
            return False
        if st.st_size != f["size"]:
            return False
        if self.entries.get(f["path"]) == (st.st_size, f["sha256"], st.st_mtime_ns):
            return True
        if sha256_file(final) == f["sha256"]:
            self.add(final, f)
            return True
        return False

    def missing(self, dest: Path, files: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(_hash_workers()) as pool:
            held = list(pool.map(lambda f: self.holds(dest, f), files))
        return [f for f, h in zip(files, held) if not h]


def clear_temporaries(staging: Path, keep: Path) -> None:
    """Delete every partially downloaded file under ``staging`` (the journal ``keep`` stays)."""
    if not staging.is_dir():
        return
    for p in staging.iterdir():
        if p != keep:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


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


def get_manifest(client: Any, bucket: str, prefix: str, uri: str) -> bytes:
    """The manifest's bytes; a prefix with objects but no manifest is an unfinished upload."""
    try:
        return get_object(client, bucket, key_of(prefix, MANIFEST_NAME), uri)
    except ObjectNotFoundError:
        pass
    root = f"{prefix}/" if prefix else ""
    with translating(uri, "s3:ListBucket"):
        found = client.list_objects_v2(Bucket=bucket, Prefix=root, MaxKeys=1).get("KeyCount", 0)
    if found:
        raise IncompleteUploadError(
            f"{uri}: the prefix has objects but no {MANIFEST_NAME}: its upload is incomplete (interrupted or still "
            "running); re-run the upload (minimax_m3.storage.upload or the command's --upload) and try again")
    raise ObjectNotFoundError(f"{uri}: nothing under this prefix; check the URI (aws s3 ls {uri.rstrip('/')}/) "
                              "or upload the directory first with --upload")


def _place(f: dict[str, Any], tmp: Path, dest: Path, uri: str, journal: Journal) -> None:
    """Check a downloaded temporary file against its manifest entry, then rename it into place."""
    size = tmp.stat().st_size
    digest = sha256_file(tmp) if size == f["size"] else "(not computed)"
    if size != f["size"] or digest != f["sha256"]:
        tmp.unlink(missing_ok=True)
        raise IntegrityError(
            f"{uri.rstrip('/')}/{f['path']}: downloaded bytes do not match the manifest (size {size} vs "
            f"{f['size']}, sha256 {digest} vs {f['sha256']}): the object was changed or corrupted after upload; "
            "re-upload the directory")
    final = dest / f["path"]
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, final)
    journal.add(final, f)


def fetch_verified(client: Any, bucket: str, prefix: str, uri: str, dest: Path, staging: Path,
                   files: list[dict[str, Any]], journal: Journal, man: dict[str, Any], *, quiet: bool,
                   config: Any = None) -> None:
    """Download ``files`` into ``staging`` in parallel; verify and rename each into ``dest``."""
    todo = journal.missing(dest, files)
    if not todo:
        return
    objects = list_objects(client, bucket, prefix, uri)
    sizes = {rel: size for rel, (size, _) in objects.items()}
    for f in todo:
        if sizes.get(f["path"]) != f["size"]:
            raise IntegrityError(
                f"{uri.rstrip('/')}/{f['path']}: the manifest lists {f['size']} bytes but the store has "
                f"{'no such object' if f['path'] not in sizes else str(sizes[f['path']]) + ' bytes'}: the prefix "
                "was changed after its upload; re-upload the directory")
    lock, total = threading.Lock(), sum(f["size"] for f in todo)
    done = man["total_bytes"] - total
    with _bar(total, f"download {uri} ({done >> 20} MiB already here)", quiet) as bar, \
            translating(uri, "s3:GetObject"), ThreadPoolExecutor(_hash_workers()) as hashers, \
            TransferManager(client, config or transfer_config()) as tm:
        jobs = []
        for f in todo:
            tmp = staging / f["path"]
            tmp.parent.mkdir(parents=True, exist_ok=True)
            fut = tm.download(bucket, key_of(prefix, f["path"]), str(tmp),
                              subscribers=[_Progress(bar, lock, *objects[f["path"]])])
            jobs.append((f, tmp, fut))
        checks = []
        try:
            for f, tmp, fut in jobs:
                fut.result()
                checks.append(hashers.submit(_place, f, tmp, dest, uri, journal))
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
    """Upload every manifest file not already stored with the same size and sha256 metadata."""
    existing = {rel: size for rel, (size, _) in list_objects(client, bucket, prefix, uri).items()}
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
    with translating(uri, "s3:PutObject"):
        client.put_object(Bucket=bucket, Key=key_of(prefix, MANIFEST_NAME), Body=data,
                          ContentType="application/json")
