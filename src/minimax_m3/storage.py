"""Local paths and ``s3://bucket/prefix`` URIs behind one small interface.

A model, checkpoint or compiled directory is named either by a local path or by an S3 prefix. An S3
prefix holds a directory uploaded by :func:`upload`: the files under their relative paths plus
``minimax-m3-manifest.json`` (relative path, size and sha256 of every file), written LAST, so a
prefix without a manifest is a half-finished upload and is refused.

* :func:`resolve` turns either form into a local directory; an S3 prefix is downloaded once into a
  cache (``$MINIMAX_M3_CACHE`` or ``~/.cache/minimax-m3/s3``) and reused while the remote manifest
  is unchanged.
* :func:`download` fetches in parallel multipart ranged GETs (boto3's ``TransferManager``), checks
  every file's size and sha256 against the manifest and renames it into place only when it matches.
  An interrupted download keeps the files already verified; a partially downloaded file is
  *restarted* (never resumed mid-file) on the next run.
* :func:`upload` sends a directory in parallel and writes the manifest last; re-running it skips
  objects that already hold the right content.

Credentials, region and endpoint come from boto3's standard chain (``AWS_PROFILE``,
``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` for S3-compatible stores, ...); retries use botocore's
``adaptive`` mode (override with ``AWS_RETRY_MODE``/``AWS_MAX_ATTEMPTS``). The boto3 part lives in
``_s3.py`` and is imported only when an S3 URI is used, so local paths need no boto3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST_NAME = "minimax-m3-manifest.json"
MANIFEST_FORMAT = "minimax-m3-manifest/1"
STAGING_NAME = ".minimax-m3-partial"  # temporary names live here until verified
LOCK_NAME = ".minimax-m3.lock"
_INTERNAL = {MANIFEST_NAME, STAGING_NAME, LOCK_NAME}


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI and the fix."""


class InvalidURIError(StorageError, ValueError):
    """The string is not a usable local path or ``s3://bucket/prefix`` URI."""


class BucketNotFoundError(StorageError):
    """The S3 bucket does not exist (at this endpoint, for these credentials)."""


class ObjectNotFoundError(StorageError):
    """Nothing exists at the local path, S3 key or S3 prefix."""


class AccessDeniedError(StorageError):
    """The credentials may not perform the S3 action (or there are no credentials)."""


class IncompleteUploadError(StorageError):
    """The S3 prefix has objects but no manifest: its upload never finished."""


class IntegrityError(StorageError):
    """A file or object does not match its manifest entry (size or sha256), or the manifest is bad."""


class TransferInterruptedError(StorageError):
    """The network or the store failed after all retries; re-running resumes."""


# ----------------------------------------------------------------------------------------- URIs


def is_s3(uri: str | os.PathLike | None) -> bool:
    """True for ``s3://...`` strings."""
    return isinstance(uri, str) and uri.startswith("s3://")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")`` (prefix without surrounding slashes)."""
    if not is_s3(uri):
        raise InvalidURIError(f"{uri!r} is not an S3 URI; write it as s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket or "*" in uri or "?" in uri:
        raise InvalidURIError(f"{uri!r} is not a valid S3 URI; write it as s3://bucket/prefix (no wildcards)")
    return bucket, prefix.strip("/")


def default_cache_dir() -> Path:
    """``$MINIMAX_M3_CACHE`` if set, else ``~/.cache/minimax-m3/s3``."""
    env = os.environ.get("MINIMAX_M3_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minimax-m3" / "s3"


def cache_path(uri: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`resolve` keeps the local copy of ``uri``: ``<cache_dir>/<bucket>/<prefix>``."""
    bucket, prefix = parse_s3_uri(uri)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root.joinpath(bucket, *[p for p in prefix.split("/") if p])


# ------------------------------------------------------------------------------------- manifest


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks (hashlib releases the GIL, so threads scale)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def build_manifest(local_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of every regular file under ``local_dir`` (internal bookkeeping files excluded)."""
    root = Path(local_dir)
    if not root.is_dir():
        raise ObjectNotFoundError(f"{root} is not a directory; pass the directory to upload")
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] not in _INTERNAL)
    if not paths:
        raise ObjectNotFoundError(f"{root} holds no files; nothing to upload")
    with ThreadPoolExecutor(_hash_workers()) as pool:
        digests = list(pool.map(sha256_file, paths))
    files = [{"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "sha256": d}
             for p, d in zip(paths, digests)]
    return {"format": MANIFEST_FORMAT, "total_bytes": sum(f["size"] for f in files), "files": files}


def parse_manifest(data: bytes, source: str) -> dict[str, Any]:
    """Validate manifest bytes; every entry needs a safe relative path, a size and a sha256."""
    try:
        man = json.loads(data)
        files = man["files"]
        if man.get("format") != MANIFEST_FORMAT or not isinstance(files, list):
            raise ValueError(f"format is {man.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        for f in files:
            p = PurePosixPath(f["path"])
            if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] in _INTERNAL:
                raise ValueError(f"unsafe path {f['path']!r}")
            if not (isinstance(f["size"], int) and f["size"] >= 0 and len(str(f["sha256"])) == 64):
                raise ValueError(f"bad size/sha256 for {f['path']!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{source}: invalid manifest ({e}); re-upload the directory with "
                             "minimax_m3.storage.upload / --upload") from None
    return man


def manifest_bytes(man: dict[str, Any]) -> bytes:
    return (json.dumps(man, indent=1, sort_keys=True) + "\n").encode()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_complete(local_dir: str | os.PathLike, manifest: dict[str, Any] | None = None,
                rehash: bool = False) -> bool:
    """True when ``local_dir`` holds its manifest (or ``manifest``) and every file has the listed size
    (and sha256 with ``rehash=True``)."""
    root = Path(local_dir)
    local = root / MANIFEST_NAME
    if not local.is_file():
        return False
    try:
        have = parse_manifest(local.read_bytes(), str(local))
    except IntegrityError:
        return False
    if manifest is not None and have["files"] != manifest["files"]:
        return False
    for f in have["files"]:
        p = root / f["path"]
        if not p.is_file() or p.stat().st_size != f["size"]:
            return False
        if rehash and sha256_file(p) != f["sha256"]:
            return False
    return True


# ---------------------------------------------------------------------------------- public API


def resolve(uri: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *,
            quiet: bool = False, rehash: bool = False, client: Any = None) -> Path:
    """A local directory (or file) holding ``uri``.

    A local path is returned as is (it must exist). An ``s3://`` prefix is downloaded into
    :func:`cache_path` unless the cache already holds a complete copy of the same manifest (one
    small GET); ``rehash=True`` also re-checks every cached file's sha256.
    """
    if not is_s3(uri):
        path = Path(uri).expanduser()
        if not path.exists():
            raise ObjectNotFoundError(f"{path} does not exist; pass an existing directory or an s3://bucket/prefix")
        return path
    return download(str(uri), cache_path(str(uri), cache_dir), quiet=quiet, rehash=rehash, client=client)


def download(uri: str, dest_dir: str | os.PathLike, *, quiet: bool = False, rehash: bool = False,
             client: Any = None, config: Any = None) -> Path:
    """Download the S3 prefix ``uri`` (uploaded by :func:`upload`) into ``dest_dir`` and verify it.

    Files land under a temporary name in ``dest_dir/.minimax-m3-partial`` and are renamed into place
    only once their size and sha256 match the manifest; the manifest is written to ``dest_dir``
    last, when everything is in place. On any failure the partial files are deleted, the verified
    ones kept, and the next call downloads only what is missing. ``config`` is an optional
    ``boto3.s3.transfer.TransferConfig``; ``client`` an optional boto3 S3 client.
    """
    from . import _s3

    bucket, prefix = parse_s3_uri(uri)
    dest = Path(dest_dir).expanduser()
    client = client or _s3.make_client()
    raw = _s3.get_manifest(client, bucket, prefix, uri)  # missing/denied/incomplete: fail before any write
    man = parse_manifest(raw, f"{uri.rstrip('/')}/{MANIFEST_NAME}")
    dest.mkdir(parents=True, exist_ok=True)
    with _s3.DirLock(dest / LOCK_NAME):
        if is_complete(dest, man, rehash=rehash):
            return dest
        (dest / MANIFEST_NAME).unlink(missing_ok=True)  # the copy is about to change: not complete
        staging = dest / STAGING_NAME
        journal = _s3.Journal(staging / "verified.jsonl")
        _s3.clear_temporaries(staging, keep=journal.path)
        try:
            _s3.fetch_verified(client, bucket, prefix, uri, dest, staging, man["files"], journal, man,
                               quiet=quiet, config=config)
        finally:
            _s3.clear_temporaries(staging, keep=journal.path)
        write_atomic(dest / MANIFEST_NAME, raw)
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def upload(local_dir: str | os.PathLike, uri: str, *, quiet: bool = False, client: Any = None,
           config: Any = None) -> dict[str, Any]:
    """Upload every file under ``local_dir`` to the S3 prefix ``uri``, then the manifest, last.

    An existing manifest at ``uri`` is deleted first, so the prefix reads as incomplete until this
    upload finishes. Objects already holding the right bytes (same size and ``sha256`` metadata) are
    skipped, so an interrupted upload is resumed by running it again. Returns the manifest.
    """
    from . import _s3

    bucket, prefix = parse_s3_uri(uri)
    man = build_manifest(local_dir)
    client = client or _s3.make_client()
    _s3.put_verified(client, bucket, prefix, uri, Path(local_dir), man, quiet=quiet, config=config)
    _s3.put_manifest(client, bucket, prefix, uri, manifest_bytes(man))
    return man


def read_bytes(uri: str | os.PathLike, *, client: Any = None) -> bytes:
    """The bytes of one local file or one S3 object (e.g. a ``config.json`` before a full download)."""
    if not is_s3(uri):
        path = Path(uri).expanduser()
        if not path.is_file():
            raise ObjectNotFoundError(f"{path} is not a file; pass an existing file path")
        return path.read_bytes()
    from . import _s3

    bucket, key = parse_s3_uri(str(uri))
    return _s3.get_object(client or _s3.make_client(), bucket, key, str(uri))


def read_text(uri: str | os.PathLike, *, client: Any = None) -> str:
    return read_bytes(uri, client=client).decode("utf-8")


# ------------------------------------------------------------------------------ CLI helpers


def _s3_uri_arg(value: str) -> str:
    try:
        parse_s3_uri(value)
    except InvalidURIError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_storage_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--upload s3://bucket/prefix`` and ``--cache-dir DIR`` to a command's parser."""
    g = parser.add_argument_group("storage (S3)")
    g.add_argument("--upload", metavar="s3://BUCKET/PREFIX", type=_s3_uri_arg, default=None,
                   help="after writing the output directory, upload it (manifest last) to this S3 prefix")
    g.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="where s3:// inputs are downloaded (default: $MINIMAX_M3_CACHE or ~/.cache/minimax-m3/s3)")
    return parser


def check_upload_target(uri: str | None, *, client: Any = None) -> None:
    """Fail early (before an hour-long compile) if ``uri``'s bucket is missing or not reachable."""
    if uri is None:
        return
    from . import _s3

    bucket, _ = parse_s3_uri(uri)
    _s3.head_bucket(client or _s3.make_client(), bucket, uri)


def maybe_upload(local_dir: str | os.PathLike, uri: str | None, *, quiet: bool = False,
                 client: Any = None) -> dict[str, Any] | None:
    """Upload ``local_dir`` to ``uri`` when ``--upload`` was given (``uri`` not None); else do nothing."""
    if uri is None:
        return None
    return upload(local_dir, uri, quiet=quiet, client=client)
