"""Old import paths that moved keep working, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import sys

import pytest

OLD, NEW = "builder.formats.speculators_transfer", "builder.reader.speculators_transfer"


def test_the_old_speculators_transfer_path_warns_and_gives_the_same_class(monkeypatch):
    transfer = pytest.importorskip("hs_connectors.transfer", reason="needs speculators: pip install -e .[trainers] "
                                   "&& pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0")
    monkeypatch.delitem(sys.modules, OLD, raising=False)  # a module warns when it runs, once per process
    with pytest.warns(DeprecationWarning, match=f"^{OLD} moved to {NEW}$"):
        old = importlib.import_module(OLD)
    new = importlib.import_module(NEW)
    assert old.HsbuildTransfer is new.HsbuildTransfer
    assert old.__all__ == ["HsbuildTransfer"]
    assert "hsbuild" in transfer.HiddenStatesBackend.registry, "importing it registers the backend, as before"
