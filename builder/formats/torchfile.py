"""`torch.save` files as trainers write and read them: saved from contiguous copies (a view would save its whole
base storage) in the default zip format (what `torch.load(mmap=True)` needs); loaded with `weights_only=True`
(a dump is data, never code) and every failure turned into a `Rejected` reason.

`save_bytes` writes exactly torch.save's bytes, faster for the many small files of an export: most of
torch.save's time on a small dict of tensors is its pickler (a Python call for every object it meets), and its
pickle (`data.pkl`) depends only on the dict's keys and its tensors' dtypes, shapes and strides (the tensors'
bytes are records of their own), not on their values. So the pickle is kept per such *signature* (a string
value, Model-Optimizer's `conversation_id`, is put in by hand: protocol 2 writes it as BINUNICODE, its
length in four bytes; a dict of more than FAST_MAX_BYTES of tensors is left to torch.save) and the zip written with torch's own writer and records, in torch.save's order. The
first reuse of each signature is compared with torch.save byte for byte; where they differ (another torch),
that signature goes back to torch.save for good.
"""

from __future__ import annotations

import gzip
import io
import struct
import sys
import threading
import zipfile
from pathlib import Path

import torch

from builder.formats.base import Rejected, Streamed

FAST_MAX_BYTES = 1 << 20  # a dict of more tensor bytes is saved by torch.save itself (its pickling costs nothing next
# to copying the bytes, and checking a kept pickle would cost a second save)
STREAM_SLACK = 1 << 14  # a bound on torch.save's bytes besides a tensor's own (its pickle, zip records, alignment)
_PICKLES: dict[tuple, tuple[bytes, int] | None] = {}  # signature -> (pickle, where the string goes) or None
_CHECKED: set[tuple] = set()  # signatures whose fast bytes were found equal to torch.save's
_LOCK = threading.Lock()


def torch_save_bytes(obj: object) -> bytes:
    """torch.save's own bytes (the reference `save_bytes` matches)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_bytes(obj: object) -> bytes:
    """torch.save's bytes of `obj`'s contiguous copy (see the module's docstring for how they are made fast)."""
    return _save_whole(_contiguous(obj))


def _save_whole(obj: object) -> bytes:
    """`save_bytes` of an `obj` that `_contiguous` gave."""
    sig = _signature(obj)
    if sig is None:
        return torch_save_bytes(obj)
    with _LOCK:
        kept = _PICKLES.get(sig, ())
    if kept == ():  # first of its kind: torch.save's, and its pickle kept
        data = torch_save_bytes(obj)
        found = _pickle_of(data, obj)
        if found is not None:
            with _LOCK:
                _PICKLES[sig] = found
        return data
    if kept is None:
        return torch_save_bytes(obj)
    data = _fast(kept, obj)  # type: ignore[arg-type]
    if sig not in _CHECKED:
        ref = torch_save_bytes(obj)
        with _LOCK:
            if ref == data:
                _CHECKED.add(sig)
            else:
                _PICKLES[sig] = None
        return ref
    return data


def save_streamed(obj: object) -> bytes | Streamed:
    """`save_bytes`, or for a dict of more than FAST_MAX_BYTES of tensors a `Streamed` torch.save straight into the
    file (torch's writer hands the tensors' own memory to `f.write`): the same bytes, without torch.save's copy
    of them into memory (an export of samples of 100+ MB)."""
    obj = _contiguous(obj)
    size = sum(v.nbytes for v in obj.values() if isinstance(v, torch.Tensor)) if type(obj) is dict else 0
    if size <= FAST_MAX_BYTES:
        return _save_whole(obj)
    strings = sum(len(v.encode("utf-8", "surrogatepass")) for v in obj.values() if type(v) is str)  # type: ignore[union-attr]
    return Streamed(size + strings + STREAM_SLACK * (len(obj) + 1), lambda f: torch.save(obj, f))


def _signature(obj: object) -> tuple | None:
    """What torch.save's pickle of `obj` depends on: a flat dict of str keys to CPU tensors, each the whole of its
    own storage (at most one str value); None for anything else (saved by torch.save itself)."""
    if type(obj) is not dict or not obj:
        return None
    sig, strings, size, seen = [], 0, 0, set()
    for k, v in obj.items():
        if type(k) is not str:
            return None
        if type(v) is str:
            if v in obj:  # (a value that is also a key may be pickled as a reference to it)
                return None
            strings += 1
            sig.append((k, "str"))
            continue
        if type(v) is not torch.Tensor or v.device.type != "cpu" or v.requires_grad or v.storage_offset() != 0 \
                or not v.is_contiguous() or v.untyped_storage().nbytes() != v.nbytes or v.dtype.is_complex:
            return None
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.nbytes:
            return None
        seen.add(ptr)
        sig.append((k, v.dtype, tuple(v.shape)))
        size += v.nbytes
    return tuple(sig) if strings <= 1 and size <= FAST_MAX_BYTES else None


def _pickle_of(data: bytes, obj: dict) -> tuple[bytes, int] | None:
    """The pickle in torch.save's bytes `data` of `obj`, and where its string value is (-1: none); None when
    that string cannot be told apart in it (tried again with the next dict of the signature)."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    value = next((v for v in obj.values() if type(v) is str), None)
    if value is None:
        return pkl, -1
    raw = value.encode("utf-8", "surrogatepass")
    enc = b"X" + struct.pack("<I", len(raw)) + raw
    return (pkl, pkl.index(enc)) if pkl.count(enc) == 1 else None


def _fast(kept: tuple[bytes, int], obj: dict) -> bytes:
    from torch.serialization import _get_storage_alignment, get_crc32_options  # noqa: PLC0415

    pkl, at = kept
    if at >= 0:
        s = next(v for v in obj.values() if type(v) is str).encode("utf-8", "surrogatepass")
        was = struct.unpack_from("<I", pkl, at + 1)[0]
        pkl = pkl[:at] + b"X" + struct.pack("<I", len(s)) + s + pkl[at + 5 + was:]
    buf = io.BytesIO()
    align = _get_storage_alignment()
    w = torch._C.PyTorchFileWriter(buf, get_crc32_options(), align)
    w.write_record("data.pkl", pkl, len(pkl))
    w.write_record(".format_version", "1", 1)
    w.write_record(".storage_alignment", str(align), len(str(align)))
    w.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for i, t in enumerate(v for v in obj.values() if type(v) is not str):
        st = t.untyped_storage()
        w.write_record(f"data/{i}", st, st.nbytes())
    w.write_end_of_file()
    return buf.getvalue()


def _contiguous(obj: object, seen: set[int] | None = None) -> object:
    """`obj` with each tensor as a contiguous tensor that is the whole of a storage of its own: torch.save's bytes of
    the result are those of a copy of every tensor. A tensor that already is that (contiguous, the whole of its
    storage, a storage no other tensor of `obj` uses: what an export's arrays mostly are) is taken as it is (its
    bytes are what its copy's would be), sparing a copy of every array of every file."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if type(t) is torch.Tensor and t.layout == torch.strided and t.is_contiguous() and not t.is_conj() \
                and not t.is_neg() and t.storage_offset() == 0 and t.nbytes:
            st = t.untyped_storage()
            if st.nbytes() == t.nbytes and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                return t
        return t.contiguous().clone()
    if isinstance(obj, dict):
        return {k: _contiguous(v, seen) for k, v in obj.items()}
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
