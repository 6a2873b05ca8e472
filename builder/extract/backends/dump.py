"""The import backend: a sample's states come from a dump file another tool wrote (SpecForge, speculators,
Model-Optimizer, a plain .pt script), not from a forward pass. The run loop is the same as for extraction, so an
import gets the same durable groups, checksums, watermarks, progress and resumability.

Each file is opened and checked before anything is staged: it loads (`truncated` / `unreadable`), has the
format's keys (`bad_keys`) with shapes consistent with the build (`bad_shape`: n tokens, n_aux*H and H wide) in
the build's dtype (`bad_dtype`), finite values (`nonfinite`), and token ids equal to the source row's
(`token_mismatch`; SpecForge's trailing (0, 0) batch padding is stripped first). A file failing any of these is
a `Failure` with reason `import_<check>`: the sample is left for `resume` to extract, and never counted against
--max-attempts. The dump's files are only read, never modified. Its final state is put in the build's
convention (post-norm derived from pre-norm with the build's final norm; the other way round is refused).

`bad_shape` here is one odd file's: a dump whose layers or width contradict the build's as a whole never gets
this far (`exchange.imports.check_dump` and `check_width` refuse it before the run dispatches anything).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.extract.backends.base import Failure, Outcome, Request, States, check_finite
from builder.extract.backends.registry import BackendSpec, RunContext, register

if TYPE_CHECKING:  # (torch and the trainer formats: imported once a worker opens the backend)
    import numpy as np
    import torch

    from builder.formats.base import Loaded
    from builder.formats.final_state import FinalNorm


@dataclass(frozen=True)
class DumpSettings:
    format: str
    hidden_size: int
    n_aux: int
    dtype: str
    final_state: str  # the build's
    dump_final_state: str = "post_norm"  # `pt` files without a flag: what their final state is


class DumpBackend:
    name = "import"
    capacity = 2  # one file in hand, one read ahead

    def __init__(self, settings: DumpSettings, norm: FinalNorm | None):
        from builder.formats import make_format  # noqa: PLC0415

        self.s = settings
        self.fmt = make_format(settings.format, final_state=settings.dump_final_state)
        self.norm = norm
        self._pending: list[Request] = []

    def submit(self, request: Request) -> None:
        self._pending.append(request)

    def collect(self, timeout: float) -> list[Outcome]:  # noqa: ARG002 - reading a file does not wait
        from builder.formats.base import Rejected  # noqa: PLC0415

        out: list[Outcome] = []
        while self._pending:
            r = self._pending.pop(0)
            try:
                out.append(self.load(r))
            except Rejected as e:
                out.append(Failure(r.key, f"import_{e.reason}", f"{r.origin}: {e}"))
            except Exception as e:  # noqa: BLE001 - one bad file must not end the import
                msg = traceback.format_exception_only(type(e), e)[-1].strip()
                out.append(Failure(r.key, "import_unreadable", f"{r.origin}: {msg}"))
        return out

    def load(self, r: Request) -> States:
        from builder.formats.base import Rejected  # noqa: PLC0415

        if r.origin is None:
            raise Rejected("unreadable", "no dump file was assigned to this sample")
        got = self.fmt.load(Path(r.origin))
        return States(r.key, *self.check(got, r.input_ids))

    def check(self, got: Loaded, want_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np  # noqa: PLC0415
        import torch  # noqa: PLC0415

        from builder.formats.base import Rejected  # noqa: PLC0415

        n, h, k = int(want_ids.shape[0]), self.s.hidden_size, self.s.n_aux
        ids, aux, final = got.input_ids, got.aux, got.final
        m = int(ids.shape[0])
        if m > n and self._padding(got, n):
            ids, aux, final = ids[:n], aux[:n], final[:n]
            m = n
        if m != n or not torch.equal(ids, torch.from_numpy(np.asarray(want_ids, dtype=np.int64))):
            first = next((i for i in range(min(m, n)) if int(ids[i]) != int(want_ids[i])), min(m, n))
            raise Rejected("token_mismatch", f"its {m} token ids differ from the source row's {n} "
                                             f"(first difference at token {first})")
        if aux.shape[1] != k * h or final.shape[1] != h:
            raise Rejected("bad_shape", f"states are {aux.shape[1]} (aux) and {final.shape[1]} (final) wide; the "
                                        f"build holds {k} aux layers of hidden size {h}: {k * h} and {h}")
        want = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.s.dtype]
        for name, t in (("aux", aux), ("final", final)):
            if t.dtype != want:
                raise Rejected("bad_dtype", f"{name} states are {t.dtype}, the build stores {want} (no lossy "
                                            "conversion on import)")
        bad = check_finite("", aux, final)
        if bad is not None:
            raise Rejected("nonfinite", bad.message)
        final = self._convert(final, got.final_state)
        return aux.contiguous(), final.contiguous()

    @staticmethod
    def _padding(got: Loaded, n: int) -> bool:
        """SpecForge pads a file to its batch's longest row with token 0 (and loss mask 0)."""
        tail = got.input_ids[n:]
        if bool((tail != 0).any()):
            return False
        return got.loss_mask is None or not bool(got.loss_mask[n:].any())

    def _convert(self, final: torch.Tensor, state: str) -> torch.Tensor:
        from builder.formats.base import Rejected  # noqa: PLC0415

        if state == self.s.final_state:
            return final
        if self.s.final_state == "post_norm" and self.norm is not None:
            return self.norm.apply(final)
        raise Rejected("bad_final_state", f"holds the final state {state.replace('_', '-')}; the build stores it "
                                          f"{self.s.final_state.replace('_', '-')} and that cannot be derived")

    def in_flight(self) -> int:
        return len(self._pending)

    def abandon_waiting(self) -> None:
        pass

    def close(self) -> None:
        self._pending.clear()


def _settings(ctx: RunContext) -> DumpSettings:
    imports, cfg, meta = ctx.imports, ctx.cfg, ctx.meta
    return DumpSettings(imports.format, int(meta["hidden_size"]), len(cfg.aux_layers or meta["aux_layers"]),
                        cfg.dtype, cfg.final_state, imports.final_state)


def _open(settings, recheck=None):  # noqa: ANN001, ARG001 - (WorkerSettings; no server to check)
    """The model's metadata only (token checks; no weights), and the build's final norm (post-norm states
    from a dump's pre-norm ones)."""
    from builder.extract.model import Extractor  # noqa: PLC0415
    from builder.formats.final_state import FinalNorm  # noqa: PLC0415

    ex = Extractor(settings.model, settings.aux_layers or None, settings.dtype, "cpu", load_weights=False)
    norm = FinalNorm.load(Path(settings.final_norm)) if settings.final_norm else None
    return ex, DumpBackend(settings.backend_settings, norm)


BACKEND = register(BackendSpec(
    name="import", summary="the workers read a dump's files", open=_open, selectable=False, device="cpu",
    reads_dumps=True, worker_settings=_settings))
