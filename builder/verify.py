"""Reading samples back and checking them against the checksums recorded in their `written` events."""

from __future__ import annotations

import json
from pathlib import Path

from .store import FIELDS, SegmentReader, checksum, chunk_paths

Finding = tuple[str, str]  # (reason, message)


def check_presence(data_root: Path, segment: str, token_start: int, num_tokens: int,
                   chunk_tokens: int) -> Finding | None:
    """Every chunk file a sample needs must exist and be non-empty (Zarr would silently fill a gap)."""
    seg = data_root / segment
    if not seg.is_dir():
        return "missing_data", f"segment {segment} is gone"
    for fld in FIELDS:
        for p in chunk_paths(seg, fld, token_start, num_tokens, chunk_tokens):
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                return "missing_data", f"chunk file {p.relative_to(data_root)} is gone"
            if size == 0:
                return "unreadable", f"chunk file {p.relative_to(data_root)} is empty"
    return None


def check_location(data_root: Path, segment: str, token_start: int, num_tokens: int, checksums: dict | str,
                   chunk_tokens: int, reader: SegmentReader | None = None) -> Finding | None:
    """Full check of one sample: presence, decodability, checksums of each field's uncompressed bytes."""
    if isinstance(checksums, str):
        checksums = json.loads(checksums)
    missing = check_presence(data_root, segment, token_start, num_tokens, chunk_tokens)
    if missing:
        return missing
    reader = reader or SegmentReader(data_root)
    try:
        raw = reader.read_raw(segment, token_start, num_tokens)
    except Exception as e:  # noqa: BLE001 - any decode failure means the bytes are unreadable
        return "unreadable", f"cannot decode: {type(e).__name__}: {str(e)[:200]}"
    bad = [f for f in FIELDS if checksum(raw[f]) != checksums.get(f)]
    if bad:
        return "checksum_mismatch", f"checksum mismatch in {', '.join(bad)}"
    return None
