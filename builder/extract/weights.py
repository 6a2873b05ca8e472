"""Content fingerprints of a Hugging Face model directory, cached so that a 600 GB checkpoint is read once.

A model's fingerprint covers the bytes of every weight and JSON file of the directory (config, tokenizer,
`*.safetensors`, `*.bin`, ...), not just their sizes: a checkpoint rewritten in place with the same sizes is a
different model. Reading every byte is the expensive part, so each file's digest is cached in
`$HSBUILD_CACHE_DIR` (default `$XDG_CACHE_HOME/hsbuild`, else `~/.cache/hsbuild`), `weights.json`, keyed by
the file's real path, device, inode, size, mtime_ns and ctime_ns. A cached digest is used only when all six are
unchanged; any write to the file changes its ctime, and unlike mtime no user can set ctime back (utime cannot),
so an in-place rewrite is always hashed again. Deleting the cache file forces a full re-hash.

A file of a Hugging Face hub snapshot is a symlink to `blobs/<sha256 or git sha1>`: the hub names each blob by
its content's hash (and checks it on download), so that name is used and the blob is not read.

Digests: SHA-256 of the file's bytes (stdlib hashlib, which uses the CPU's SHA extensions where present and
releases the GIL, so several shards are hashed in parallel threads; read in 16 MiB blocks). SHA-256 is also
what the hub names LFS blobs by, so a blob's name and a copied file's digest agree. See docs/design.md for the
measured throughput.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FINGERPRINTED_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt", ".tiktoken"}
BLOCK = 16 << 20
HUB_BLOB_RE = re.compile(r"^(?:[0-9a-f]{64}|[0-9a-f]{40})$")
CACHE_NAME = "weights.json"
SCHEME = "sha256"


def cache_dir() -> Path:
    if os.environ.get("HSBUILD_CACHE_DIR"):
        return Path(os.environ["HSBUILD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hsbuild"


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _hub_digest(path: Path) -> str | None:
    """The content hash a hub snapshot symlink into `blobs/` is named by: the SHA-256 of an LFS file (what
    `file_digest` computes), or the git SHA-1 of a small one."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and HUB_BLOB_RE.match(target.name):
        return target.name if len(target.name) == 64 else f"git-sha1:{target.name}"
    return None


class DigestCache:
    """The per-file digest cache (a small JSON file). Unreadable or unwritable: hash without caching."""

    def __init__(self, directory: Path | None = None):
        self.path = (directory or cache_dir()) / CACHE_NAME
        self.entries: dict[str, dict] = {}
        self.dirty = False
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
            if isinstance(data, dict) and data.get("scheme") == SCHEME and isinstance(data.get("files"), dict):
                self.entries = data["files"]

    def get(self, real: str, key: list[int]) -> str | None:
        e = self.entries.get(real)
        return e["digest"] if isinstance(e, dict) and e.get("key") == key else None

    def put(self, real: str, key: list[int], digest: str) -> None:
        self.entries[real] = {"key": key, "digest": digest}
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:  # merge: another process may have cached other files meanwhile
                theirs = json.loads(self.path.read_text()).get("files", {})
            except (OSError, ValueError, AttributeError):
                theirs = {}
            merged = {**(theirs if isinstance(theirs, dict) else {}), **self.entries}
            merged = {k: v for k, v in merged.items() if os.path.exists(k)}  # forget deleted files
            tmp = self.path.with_name(f".{CACHE_NAME}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"scheme": SCHEME, "files": merged}, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a cache we cannot write only costs time
        self.dirty = False


def model_files(model_dir: Path) -> list[Path]:
    return sorted(f for f in model_dir.iterdir() if f.suffix in FINGERPRINTED_SUFFIXES and f.is_file())


def directory_fingerprint(model_dir: str | Path, cache: DigestCache | None = None, jobs: int = 4) -> str:
    """A 64-bit fingerprint of the directory's files: their names and content digests."""
    model_dir = Path(model_dir)
    cache = cache or DigestCache()
    files = model_files(model_dir)
    digests: dict[Path, str] = {}
    todo: list[tuple[Path, str, list[int]]] = []
    for f in files:
        hub = _hub_digest(f)
        if hub is not None:
            digests[f] = hub
            continue
        real = os.path.realpath(f)
        key = _stat_key(os.stat(real))
        cached = cache.get(real, key)
        if cached is not None:
            digests[f] = cached
        else:
            todo.append((f, real, key))
    if todo:
        with ThreadPoolExecutor(max(1, min(jobs, len(todo))), thread_name_prefix="hsbuild-hash") as pool:
            for (f, real, key), digest in zip(todo, pool.map(lambda t: file_digest(Path(t[1])), todo),
                                              strict=True):
                # a file written while it was hashed has a new ctime: cache under the key seen before hashing
                # only if it still holds
                if _stat_key(os.stat(real)) == key:
                    cache.put(real, key, digest)
                digests[f] = digest
        cache.save()
    h = hashlib.blake2b(b"hf-content-v1:", digest_size=8)
    for f in files:
        h.update(f"{f.name}:{digests[f]}\n".encode())
    return h.hexdigest()
