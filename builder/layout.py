"""Where things live inside a build directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from builder.errors import BuildNotFoundError

CONFIG_NAME = "hsbuild.toml"
EVENTS_NAME = "events.duckdb"
DATA_NAME = "data"
LOCK_NAME = "hsbuild.lock"
BALLAST_NAME = ".ballast"


@dataclass(frozen=True)
class BuildLayout:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_NAME

    @property
    def events(self) -> Path:
        return self.root / EVENTS_NAME

    @property
    def wal(self) -> Path:
        """DuckDB's write-ahead log beside the event log: commits not yet folded into the database file."""
        return self.root / (EVENTS_NAME + ".wal")

    @property
    def data(self) -> Path:
        return self.root / DATA_NAME

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def final_norm(self) -> Path:
        """The model's final norm (weight, epsilon): the other final-state convention, derived."""
        return self.root / "final_norm.safetensors"

    @property
    def ballast(self) -> Path:
        return self.root / BALLAST_NAME

    def exists(self) -> bool:
        return self.config.is_file() and self.events.is_file()

    def unfinished_init(self) -> bool:
        """An `init` that did not finish (killed before it wrote the config, which it writes last)."""
        return not self.config.is_file() and (self.events.exists() or self.data.exists())

    def require(self) -> BuildLayout:
        if self.config.is_file() and self.data.is_dir() and not self.events.is_file():
            raise BuildNotFoundError(
                f"{self.events}: the event log is missing (deleted, or lost in a crash); rebuild it from the data "
                f"with `hsbuild rebuild-log {self.root}`"
            )
        if not self.exists() and self.unfinished_init():
            raise BuildNotFoundError(
                f"{self.root}: an unfinished init left this directory (no {CONFIG_NAME}); run "
                f"`hsbuild init {self.root} --source FILE --force` to create the build again"
            )
        if not self.exists():
            raise BuildNotFoundError(
                f"{self.root}: not an hsbuild build (no {CONFIG_NAME} / {EVENTS_NAME}); "
                f"create one with `hsbuild init {self.root} --source FILE`"
            )
        return self


def layout(path: str | Path) -> BuildLayout:
    return BuildLayout(Path(path).absolute())
