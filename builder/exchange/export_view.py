"""What an export lends a format that needs more of the build than a sample's arrays (formats/base.py
`BuildView`, `TrainerFormat.prepare`): the build's metadata, its source's rows as they are now, its tokenizer and
its samples' `written` details. Each part is read only when a format asks for it: a trainer format asks for none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from builder.config import load_config
from builder.errors import SourceError
from builder.formats.base import SourceRow
from builder.layout import BuildLayout

WRITTEN_SQL = """
SELECT e.sample_id, e.detail FROM events e JOIN samples s
  ON s.sample_id = e.sample_id AND e.kind = 'written' AND s.segment = e.segment AND s.token_start = e.token_start
WHERE e.sample_id IN (SELECT unnest(?))
QUALIFY row_number() OVER (PARTITION BY e.sample_id ORDER BY e.seq DESC) = 1
"""


class ExportBuildView:
    def __init__(self, lay: BuildLayout, query: Callable[[str, list], list[dict]], meta: Callable[[], dict]):
        self.lay = lay
        self._query = query
        self._meta = meta
        self._tokenizer = None
        self._cfg = None

    @property
    def cfg(self):  # noqa: ANN201 - (BuildConfig)
        if self._cfg is None:
            self._cfg = load_config(self.lay)
        return self._cfg

    def meta(self) -> dict:
        return self._meta()

    @property
    def tokenizer(self):  # noqa: ANN201 - (the build's tokenizer: extract/chat.py's Tokenizer, with decode)
        if self._tokenizer is None:
            from builder.extract.build_meta import model_info  # noqa: PLC0415 - (torch for the builtin model)

            self._tokenizer = model_info(self.cfg.model, None, self.cfg.dtype, "post_norm").tokenizer
        return self._tokenizer

    def source_rows(self, sample_ids: Iterable[str]) -> tuple[bool, dict[str, SourceRow]]:
        from builder.extract.build_meta import source_samples  # noqa: PLC0415
        from builder.extract.source_lookup import lookup_rows  # noqa: PLC0415

        source = Path(self.cfg.source)
        if not source.exists():
            raise SourceError(str(source), "the build's source is not there; if it moved, tell the build with "
                              f"`hsbuild resume {self.lay.root} --source NEWPATH`, else restore the file")
        # the source read as `init` reads it (its fingerprints are then the log's for every unchanged row)
        return lookup_rows(source, sample_ids, source_samples(self.lay))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def written(self, sample_ids: Iterable[str]) -> dict[str, dict]:
        rows = self._query(WRITTEN_SQL, [list(sample_ids)])
        return {r["sample_id"]: json.loads(r["detail"]) if isinstance(r["detail"], str) else (r["detail"] or {})
                for r in rows}
