"""A Hugging Face `datasets` directory (`Dataset.save_to_disk`) as a source, read with pyarrow only.

Such a directory (speculators' preprocessed data, for one) holds `state.json`, `dataset_info.json` and Arrow IPC
*stream* files `data-XXXXX-of-NNNNN.arrow`, one table in the order state.json's `_data_files` lists them.
Row i is sample `i` (speculators names its hidden-state files `hs_{i}`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from builder.errors import SourceError

STATE = "state.json"
DIR_HINT = "pass a .jsonl or .parquet file, or a `datasets` save_to_disk directory, with --source"


def is_dataset_dir(path: Path) -> bool:
    return (path / STATE).is_file()


def refuse_other_dir(path: Path) -> None:
    """A directory that is not one `Dataset` of save_to_disk: say what it is instead."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        except (OSError, ValueError, AttributeError):
            splits = []
        pick = f" (splits: {', '.join(map(str, splits))}); pass one split's directory, e.g. {path / splits[0]}" \
            if splits else "; pass one split's directory"
        raise SourceError(path, f"is a `datasets` DatasetDict{pick}")
    raise SourceError(path, f"is a directory without {STATE} (not a `datasets` save_to_disk directory); {DIR_HINT}")


def read_dataset_dir(path: Path) -> pa.Table:
    """The directory's rows as one table. Raises SourceError naming the file at fault."""
    state_path = path / STATE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:  # json's own line and column
        raise SourceError(state_path, f"malformed JSON: {e.msg.removesuffix(' at')} at column {e.colno}",
                          line=e.lineno) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SourceError(state_path, f"cannot be read as JSON ({e})") from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise SourceError(state_path, "has no '_data_files' list of {\"filename\": ...} entries; is this a "
                                      "`datasets` save_to_disk directory?", field="_data_files")
    tables = []
    for entry in files:
        name = entry["filename"]
        f = path / name
        if Path(name).name != name:
            raise SourceError(state_path, f"names '{name}', which is not a file of the directory", field="_data_files")
        if not f.is_file():
            raise SourceError(f, f"is missing (listed in {STATE})")
        try:
            tables.append(ipc.open_stream(pa.memory_map(str(f))).read_all())  # zero-copy: the map lives on
        except (pa.ArrowInvalid, OSError) as e:
            raise SourceError(f, f"is not an Arrow IPC stream ({str(e).splitlines()[0]})") from None
    try:
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as e:
        raise SourceError(path, f"its data files have different columns ({str(e).splitlines()[0]})") from None
