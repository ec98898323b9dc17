"""Local paths and ``s3://bucket/prefix`` URIs behind one small interface.

A model, checkpoint or compiled directory is named either by a local path or by an S3 prefix. A
prefix uploaded by :func:`upload` holds the files under their relative paths plus
``minimax-m3-manifest.json`` (relative path, size and sha256 of every file), written LAST; while
that upload runs the prefix also holds ``minimax-m3-upload-in-progress.json``, so a prefix with the
marker and no manifest is this package's unfinished upload and is refused. A prefix without either
was written by other tools (``aws s3 sync``, boto3) and is loaded from its listing.

* :func:`resolve` turns either form into a local directory; an S3 prefix is downloaded once into a
  cache (``$MINIMAX_M3_CACHE`` or ``~/.cache/minimax-m3/s3``) and reused while the remote manifest
  (or, without one, the listing: keys, sizes, ETags) is unchanged.
* :func:`download` fetches in parallel multipart ranged GETs (boto3's ``TransferManager``), checks
  every file's size and sha256 against the manifest (without one: size and, for a plain ETag, MD5)
  and renames it into place only when it matches. An interrupted download keeps the files already
  verified; a partially downloaded file is *restarted* (never resumed mid-file) on the next run.
* :func:`upload` sends a directory in parallel and writes the manifest last; re-running it skips
  objects that already hold the right content.

Credentials, region and endpoint come from boto3's standard chain (``AWS_PROFILE``,
``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` for S3-compatible stores, ...); retries use botocore's
``adaptive`` mode (override with ``AWS_RETRY_MODE``/``AWS_MAX_ATTEMPTS``). The boto3 part lives in
``_s3.py`` and is imported only when an S3 URI is used, so local paths need no boto3.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from .manifest import (  # noqa: F401  (re-exported: the public names live here)
    LISTING_SOURCE, LOCK_NAME, MANIFEST_FORMAT, MANIFEST_NAME, STAGING_NAME, UPLOADING_NAME, AccessDeniedError,
    BucketNotFoundError, DirLock, IncompleteUploadError, IntegrityError, InvalidURIError, Journal, ObjectNotFoundError,
    StorageError, TransferInterruptedError, build_manifest, clear_temporaries, etag_md5, file_digests, is_complete,
    manifest_bytes, parse_manifest, read_local_manifest, sha256_file, write_atomic,
)


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
    """Download the S3 prefix ``uri`` into ``dest_dir`` and verify it.

    A prefix uploaded by :func:`upload` is checked against its manifest (size and sha256 of every
    file). A prefix written by other tools (``aws s3 sync``, ``aws s3 cp --recursive``, boto3's
    ``upload_file``) has no manifest: its paginated listing stands in for one, each file is checked
    against the listed size and, where the ETag is a plain MD5 (single-part upload, not KMS), that MD5.
    Files land under a temporary name in ``dest_dir/.minimax-m3-partial`` and are renamed into place
    only once verified; a manifest is written to ``dest_dir`` last, when everything is in place (for a
    listed prefix: path, size, sha256 and ETag of every file, so later calls cost one listing). On any
    failure the partial files are deleted, the verified ones kept, and the next call downloads only
    what is missing. ``config`` is an optional ``boto3.s3.transfer.TransferConfig``; ``client`` an
    optional boto3 S3 client.
    """
    from . import s3 as _s3

    bucket, prefix = parse_s3_uri(uri)
    dest = Path(dest_dir).expanduser()
    client = client or _s3.make_client()
    cached = read_local_manifest(dest)
    # missing/denied/incomplete/empty: fail before any write
    raw, listed = _s3.remote_state(client, bucket, prefix, uri,
                                   list_first=cached is not None and cached.get("source") == LISTING_SOURCE)
    if raw is not None:
        man = parse_manifest(raw, f"{uri.rstrip('/')}/{MANIFEST_NAME}")
    else:
        man = {"format": MANIFEST_FORMAT, "source": LISTING_SOURCE, "files": listed,
               "total_bytes": sum(f["size"] for f in listed)}
    dest.mkdir(parents=True, exist_ok=True)
    with DirLock(dest / LOCK_NAME):
        if is_complete(dest, man, rehash=rehash):
            return dest
        previous = read_local_manifest(dest)  # its sha256s vouch for unchanged files of a listed prefix
        (dest / MANIFEST_NAME).unlink(missing_ok=True)  # the copy is about to change: not complete
        staging = dest / STAGING_NAME
        journal = Journal(staging / "verified.jsonl", previous and previous["files"])
        clear_temporaries(staging, keep=journal.path)
        try:
            _s3.fetch_verified(client, bucket, prefix, uri, dest, staging, man["files"], journal,
                               quiet=quiet, config=config)
        finally:
            clear_temporaries(staging, keep=journal.path)
        if raw is None:  # the listing, with the sha256 of every verified file, becomes the local manifest
            files = [{"path": f["path"], "size": f["size"], "etag": f["etag"],
                      "sha256": journal.entries[f["path"]]["sha256"]} for f in listed]
            raw = manifest_bytes({**man, "files": files})
        write_atomic(dest / MANIFEST_NAME, raw)
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def upload(local_dir: str | os.PathLike, uri: str, *, quiet: bool = False, client: Any = None,
           config: Any = None) -> dict[str, Any]:
    """Upload every file under ``local_dir`` to the S3 prefix ``uri``, then the manifest, last.

    The marker ``minimax-m3-upload-in-progress.json`` is written first and an existing manifest deleted,
    so the prefix reads as this package's unfinished upload (refused by :func:`download`, unlike a
    prefix written by other tools) until the manifest is written; the marker is deleted after it.
    Objects already holding the right bytes (same size and ``sha256`` metadata) are skipped, so an
    interrupted upload is resumed by running it again. Returns the manifest.
    """
    from . import s3 as _s3

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
    from . import s3 as _s3

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
    from . import s3 as _s3

    bucket, _ = parse_s3_uri(uri)
    _s3.head_bucket(client or _s3.make_client(), bucket, uri)


def maybe_upload(local_dir: str | os.PathLike, uri: str | None, *, quiet: bool = False,
                 client: Any = None) -> dict[str, Any] | None:
    """Upload ``local_dir`` to ``uri`` when ``--upload`` was given (``uri`` not None); else do nothing."""
    if uri is None:
        return None
    return upload(local_dir, uri, quiet=quiet, client=client)
