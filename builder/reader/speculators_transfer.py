"""speculators reads a build directly: a `hs_connectors.HiddenStatesTransfer` whose cached samples come from the
build instead of `hidden_states/hs_{i}.safetensors` files.

    from speculators.train.data import ArrowDataset
    from builder.reader.speculators_transfer import HsbuildTransfer

    ds = ArrowDataset(max_len=8192, datapath="data/prepared",      # speculators' own preprocessed dataset ...
                      transfer=HsbuildTransfer("BUILD"),          # ... which is the build's --source
                      on_missing="skip")

Row i of the dataset is the build's source row i (a `datasets` directory given to `hsbuild init --source` keeps
its row order), so the build must have been made from the same dataset directory; ArrowDataset itself checks
each row's token ids against what the transfer returns. A row the build does not hold (yet) is `None`, and
`on_missing` decides ("skip", "warn", "raise"). The build must store the pre-norm final state
(`hsbuild init --final-state pre_norm`): speculators applies the verifier's norm itself. Every read is checked
(chunk presence, CRC-32C): a damaged sample raises `DamagedSampleError`, never zeros.

Registered in speculators' backend registry as "hsbuild" when this module is imported (before speculators
parses its arguments), so its trainer also takes `--hidden-states-backend hsbuild --hsbuild-build BUILD`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer

from builder.reader.dataset import HiddenStateDataset


class HsbuildTransfer(HiddenStatesTransfer):
    def __init__(self, build: str | Path, verify_checksums: bool = True):
        self.build = str(build)
        self.verify_checksums = verify_checksums
        self._ds: HiddenStateDataset | None = None

    def setup(self) -> None:
        if self._ds is None:  # per process: a DataLoader worker opens its own reader (its index: a mapped file)
            self._ds = HiddenStateDataset(self.build, verify_checksums=self.verify_checksums, format="speculators")

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        self.setup()
        assert self._ds is not None
        i = self._ds.index.position_of_row(int(file_idx))  # (no dict of every row in every worker)
        if i is None:
            return None
        s = self._ds.sample(i)
        return {"hidden_states": self._ds.format.stacked(s), "token_ids": s.input_ids}  # the speculators format's

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:  # noqa: ARG002
        return None  # a build is filled by `hsbuild run`, not by the trainer's requests


def _register() -> None:
    if "hsbuild" in HiddenStatesBackend.registry:
        return

    @HiddenStatesBackend.register("hsbuild")
    class HsbuildBackend(HiddenStatesBackend):
        @staticmethod
        def add_train_args(parser) -> None:
            if not any("--hsbuild-build" in a.option_strings for a in parser._actions):
                parser.add_argument("--hsbuild-build", help="the hsbuild build holding the hidden states")

        @staticmethod
        def add_launch_args(parser) -> None:  # noqa: ARG004 - nothing to launch: hsbuild fills the build
            return None

        @staticmethod
        def from_train_args(args, data_path: str) -> HiddenStatesTransfer:  # noqa: ARG004
            return HsbuildTransfer(args.hsbuild_build)

        @staticmethod
        def build_kv_transfer_config(args) -> dict[str, Any]:  # noqa: ARG004
            raise NotImplementedError("the hsbuild backend reads a finished build; use `hsbuild run` to fill it")


_register()
