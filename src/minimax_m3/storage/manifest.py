"""The local half of :mod:`minimax_m3.storage`: error types, bookkeeping names, hashing, manifests, locks.

Shared by ``storage`` (the public interface) and ``_s3`` (the boto3 half); imports neither, so the two
never import each other. ``storage`` re-exports every public name defined here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from .._atomic import write_atomic  # noqa: F401  (re-exported through storage)
from ..errors import M3Error

MANIFEST_NAME = "minimax-m3-manifest.json"
MANIFEST_FORMAT = "minimax-m3-manifest/1"
UPLOADING_NAME = "minimax-m3-upload-in-progress.json"  # on S3 while our upload runs; deleted after the manifest
STAGING_NAME = ".minimax-m3-partial"  # temporary names live here until verified
LOCK_NAME = ".minimax-m3.lock"
_INTERNAL = {MANIFEST_NAME, UPLOADING_NAME, STAGING_NAME, LOCK_NAME}
LISTING_SOURCE = "s3-listing"  # a local manifest written after downloading a prefix that had none
_PLAIN_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')


class StorageError(M3Error, RuntimeError):
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
    """The S3 prefix holds this package's upload-in-progress marker and no manifest: the upload never finished."""


class IntegrityError(StorageError):
    """A file or object does not match its manifest entry or listing (size, sha256 or MD5), or the manifest is bad."""


class TransferInterruptedError(StorageError):
    """The network or the store failed after all retries; re-running resumes."""


# --------------------------------------------------------------------------------------- hashing


def file_digests(path: str | os.PathLike, *, md5: bool = False, chunk: int = 8 << 20) -> tuple[str, str | None]:
    """Hex sha256 (and MD5 with ``md5=True``, else None) of a file in one pass of 8 MiB reads.

    hashlib releases the GIL, so threads scale.
    """
    sha, m5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False) if md5 else None
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
            if m5 is not None:
                m5.update(block)
    return sha.hexdigest(), (m5.hexdigest() if m5 is not None else None)


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks."""
    return file_digests(path, chunk=chunk)[0]


def etag_md5(etag: str | None) -> str | None:
    """The MD5 an S3 ETag carries: a plain 32-hex ETag (single-part upload), else None (``-N`` multipart)."""
    m = _PLAIN_ETAG.match(etag or "")
    return m.group(1).lower() if m else None


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


# ------------------------------------------------------------------------------------- manifest


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


def unsafe_path(rel: str) -> str | None:
    """Why ``rel`` cannot be a file's path under a directory (None when it can)."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or not p.parts or "//" in rel or rel.endswith("/"):
        return f"unsafe path {rel!r}"
    if p.parts[0] in _INTERNAL:
        return f"reserved name {p.parts[0]!r}"
    return None


def parse_manifest(data: bytes, source: str) -> dict[str, Any]:
    """Validate manifest bytes; every entry needs a safe relative path, a size and a sha256."""
    try:
        man = json.loads(data)
        files = man["files"]
        if man.get("format") != MANIFEST_FORMAT or not isinstance(files, list):
            raise ValueError(f"format is {man.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        for f in files:
            if why := unsafe_path(f["path"]):
                raise ValueError(why)
            if not (isinstance(f["size"], int) and f["size"] >= 0 and len(str(f["sha256"])) == 64):
                raise ValueError(f"bad size/sha256 for {f['path']!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{source}: invalid manifest ({e}); re-upload the directory with "
                             "minimax_m3.storage.upload / --upload") from None
    return man


def manifest_bytes(man: dict[str, Any]) -> bytes:
    return (json.dumps(man, indent=1, sort_keys=True) + "\n").encode()


def read_local_manifest(local_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest a finished download left in ``local_dir`` (None when absent or unreadable)."""
    local = Path(local_dir) / MANIFEST_NAME
    if not local.is_file():
        return None
    try:
        return parse_manifest(local.read_bytes(), str(local))
    except IntegrityError:
        return None


def _same_files(have: dict[str, Any], want: dict[str, Any]) -> bool:
    """Same remote content: equal entries, or for a listing equal (path, size, etag) per file."""
    if want.get("source") != LISTING_SOURCE:
        return have["files"] == want["files"]
    key = lambda man: [(f["path"], f["size"], f.get("etag")) for f in man["files"]]  # noqa: E731
    return have.get("source") == LISTING_SOURCE and key(have) == key(want)


def is_complete(local_dir: str | os.PathLike, manifest: dict[str, Any] | None = None,
                rehash: bool = False) -> bool:
    """True when ``local_dir`` holds its manifest (matching ``manifest``, a remote manifest or a listing)
    and every file has the listed size (and sha256 with ``rehash=True``)."""
    root = Path(local_dir)
    have = read_local_manifest(root)
    if have is None or (manifest is not None and not _same_files(have, manifest)):
        return False
    for f in have["files"]:
        p = root / f["path"]
        if not p.is_file() or p.stat().st_size != f["size"]:
            return False
        if rehash and sha256_file(p) != f["sha256"]:
            return False
    return True


# ------------------------------------------------------------------------- download bookkeeping


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
    """Files already verified and renamed into place: their sha256, (size, mtime_ns) at that moment and,
    for a prefix without a manifest, the ETag they were checked against.

    A file whose stat still matches is trusted on resume without re-hashing; one that is present with
    the right size but unrecorded is re-hashed and kept when it matches its sha256, its ETag's MD5, or
    the sha256 that the ``previous`` local manifest recorded for the same ETag (a multipart ETag is no
    MD5); anything else is downloaded again.
    """

    def __init__(self, path: Path, previous: list[dict[str, Any]] | None = None):
        self.path, self._lock, self.entries = path, threading.Lock(), {}
        self.previous = {f["path"]: f for f in previous or [] if f.get("etag") is not None}
        if path.is_file():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    e = json.loads(line)
                    self.entries[e["path"]] = {k: e.get(k) for k in ("size", "sha256", "mtime_ns", "etag")}

    def add(self, final: Path, f: dict[str, Any], sha256: str) -> None:
        st = final.stat()
        e = {"size": st.st_size, "sha256": sha256, "mtime_ns": st.st_mtime_ns, "etag": f.get("etag")}
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"path": f["path"], **e}) + "\n")
            self.entries[f["path"]] = e

    def holds(self, dest: Path, f: dict[str, Any]) -> bool:
        final = dest / f["path"]
        try:
            st = final.stat()
        except FileNotFoundError:
            return False
        if st.st_size != f["size"]:
            return False
        e = self.entries.get(f["path"])
        if e and (e["size"], e["mtime_ns"]) == (st.st_size, st.st_mtime_ns) and (
                e["sha256"] == f["sha256"] if "sha256" in f else e["etag"] == f["etag"]):
            return True
        prev = self.previous.get(f["path"])
        prev = prev if prev and (prev["size"], prev["etag"]) == (f["size"], f.get("etag")) else None
        if "sha256" not in f and "md5" not in f and prev is None:
            return False  # a multipart ETag seen for the first time: nothing to check the local bytes against
        sha, md5 = file_digests(final, md5="md5" in f)
        if sha == f.get("sha256") or (md5 is not None and md5 == f["md5"]) or (prev and sha == prev["sha256"]):
            self.add(final, f, sha)
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
