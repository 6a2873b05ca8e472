"""`torch.save` files as trainers write and read them: saved from contiguous copies (a view would save its whole
base storage) in the default zip format (what `torch.load(mmap=True)` needs); loaded with `weights_only=True`
(a dump is data, never code) and every failure turned into a `Rejected` reason."""

from __future__ import annotations

import gzip
import io
import zipfile
from pathlib import Path

import torch

from builder.formats.base import Rejected


def save_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(_contiguous(obj), buf)
    return buf.getvalue()


def _contiguous(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().contiguous().clone()
    if isinstance(obj, dict):
        return {k: _contiguous(v) for k, v in obj.items()}
    return obj


def _require_whole_zip(f, size: int) -> None:
    """torch.save writes a zip archive: one that starts like one but has no end-of-central-directory record was
    cut short (torch itself says only `Invalid argument`)."""
    head = f.read(4)
    f.seek(0)
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(f):
        raise Rejected("truncated", f"a torch.save archive cut short: no end-of-central-directory record "
                                    f"({size} bytes)")
    f.seek(0)


def load_dict(src: Path | io.BytesIO) -> dict:
    """A torch.save'd dict; Rejected('truncated'|'unreadable'|'bad_keys', ...) when it is not one."""
    try:
        if isinstance(src, Path):
            size = src.stat().st_size
            if size == 0:
                raise Rejected("truncated", "is empty (0 bytes)")
            with src.open("rb") as f:
                _require_whole_zip(f, size)
            d = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        else:
            _require_whole_zip(src, len(src.getbuffer()))
            src.seek(0)
            d = torch.load(src, map_location="cpu", weights_only=True)
    except Rejected:
        raise
    except (zipfile.BadZipFile, EOFError) as e:
        raise Rejected("truncated", f"torch.load fails: the file is cut short ({type(e).__name__}: {e})") from None
    except RuntimeError as e:
        msg = str(e).splitlines()[0][:200]
        reason = "truncated" if any(w in msg for w in ("central directory", "file_size", "truncated",
                                                      "failed finding", "PytorchStreamReader")) else "unreadable"
        raise Rejected(reason, f"torch.load fails ({msg})") from None
    except Exception as e:  # noqa: BLE001 - pickle errors, unsupported globals: the file is not a usable sample
        raise Rejected("unreadable", f"torch.load fails ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(d, dict):
        raise Rejected("bad_keys", f"holds a {type(d).__name__}, not a dict of tensors")
    return d


def load_file(path: Path) -> dict:
    """`load_dict` of a file, which may be a gzip stream of torch.save bytes (`.gz`, SpecForge's --compress)."""
    if not path.name.endswith(".gz"):
        return load_dict(path)
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise Rejected("truncated", f"gzip stream does not decode ({type(e).__name__}: {e})") from None
    return load_dict(io.BytesIO(raw))


def int_1d(d: dict, keys: tuple[str, ...], batch_axis: bool = True) -> torch.Tensor:
    """The first of `keys` in `d` as int64 [n]; [1, n] is taken too when `batch_axis`. Raises Rejected."""
    key = next((k for k in keys if isinstance(d.get(k), torch.Tensor)), None)
    if key is None:
        raise Rejected("bad_keys", f"has no tensor {' or '.join(repr(k) for k in keys)} (keys: {sorted(d)})")
    t = d[key]
    if batch_axis and t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex:
        raise Rejected("bad_shape", f"'{key}' is {t.dtype} {list(t.shape)}, expected integers [n]")
    return t.long()
