"""A Hypothesis state machine over the real data + log layers (DuckDB file, Zarr segments on disk): writers
write samples, batches commit, writers crash (losing what was not committed and abandoning their segment),
the log's owner crashes (a real process SIGKILLed before, during or after committing a batch; the log is then
reopened from the file, DuckDB replaying its WAL), samples are retried. Invariants after every step: each
sample is live at most once, exactly the committed writes are live (a batch commits whole or not at all, and a
commit the owner saw return survives its death), and every live sample reads back its own bytes and
checksums."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from owner_proc import own_and_commit

from builder.extract.source import Sample
from builder.log.events import Event, EventLog
from builder.run.worker_start import worker_context
from builder.store.readback import check_location
from builder.store.reader import SegmentReader
from builder.store.segment import SegmentWriter, init_data_group, new_segment_name

IDS = [f"s{i}" for i in range(6)]
H, N_AUX, C = 8, 3, 4

# Owner processes fork from the server that hsbuild's workers fork from (builder/run/worker_start.py: torch and
# numpy already imported), so a crash costs a fraction of a second, not an interpreter start.
OWNER_CRASHES = 2  # per example: each costs a process and two opens of the log


def payload(sid: str, attempt: int, n: int):
    g = torch.Generator().manual_seed(hash((sid, attempt)) % (1 << 31))
    aux = torch.randn(n, N_AUX * H, generator=g).to(torch.bfloat16)
    final = torch.randn(n, H, generator=g).to(torch.bfloat16)
    return np.arange(n, dtype=np.int32) + attempt, np.ones(n, dtype=np.uint8), aux, final


class BuildMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hsbuild-sm-"))
        init_data_group(self.dir / "data", {})
        self.log = EventLog(self.dir / "events.duckdb")
        z = np.zeros(1, dtype=np.int32)
        self.log.register_samples([Sample(s, i, z, z.astype(np.uint8), "fp") for i, s in enumerate(IDS)])
        self.writer = self._new_writer()
        self.pending: list[Event] = []
        self.expected: dict[str, tuple] = {}  # sid -> payload of its committed, live write
        self.staged: dict[str, tuple] = {}
        self.attempt = 0
        self.owner_crashes = 0

    def _new_writer(self) -> SegmentWriter:
        return SegmentWriter(self.dir / "data", new_segment_name("r" * 8, 0), H, N_AUX, C, "zstd:1").create()

    @rule(sid=st.sampled_from(IDS), n=st.integers(1, 11))
    def write(self, sid, n):
        self.attempt += 1
        data = payload(sid, self.attempt, n)
        self.pending.append(Event("started", sample_id=sid, attempt=self.attempt))
        loc = self.writer.write(*data)
        self.pending.append(Event("written", sample_id=sid, attempt=self.attempt, segment=loc.segment,
                                  token_start=loc.token_start, num_tokens=loc.num_tokens, nbytes=loc.nbytes,
                                  checksums=json.dumps(loc.checksums)))
        self.staged[sid] = data

    @rule(sid=st.sampled_from(IDS))
    def fail(self, sid):
        self.pending.append(Event("failed", sample_id=sid, reason="nonfinite"))
        self.staged[sid] = None

    @rule()
    def commit(self):
        self.log.append(self.pending)
        self.commit_staged()

    def commit_staged(self):
        self.pending = []
        for sid, data in self.staged.items():
            if data is None:
                self.expected.pop(sid, None)
            else:
                self.expected[sid] = data
        self.staged = {}

    @rule()
    def crash(self):
        # kill -9: uncommitted events vanish; the writer's segment is abandoned mid-way, never reopened
        self.pending, self.staged = [], {}
        self.writer = self._new_writer()

    def _event_count(self) -> int:
        return self.log.con.execute("SELECT count(*) FROM events").fetchone()[0]

    @precondition(lambda self: self.pending and self.owner_crashes < OWNER_CRASHES)
    @rule(delay_ms=st.integers(0, 80))
    def owner_crash(self, delay_ms):
        """The coordinator (the log's owner, here a real process) is SIGKILLed `delay_ms` after it starts to
        commit the pending batch: before, during or after the commit (one takes ~5-40 ms). Its workers die with
        it."""
        self.owner_crashes += 1
        batch, before = self.pending, self._event_count()
        self.log.close()
        owners = worker_context()
        ours, theirs = owners.Pipe()
        owner = owners.Process(target=own_and_commit, args=(str(self.dir / "events.duckdb"), batch, theirs),
                               daemon=True)
        owner.start()
        theirs.close()
        assert ours.poll(60) and ours.recv() == "open"
        time.sleep(delay_ms / 1000)
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(60)
        assert owner.exitcode == -signal.SIGKILL
        said = []
        while ours.poll(0):  # what the owner said before it died (then EOF)
            try:
                said.append(ours.recv())
            except EOFError:
                break
        ours.close()
        acked = "committed" in said
        self.log = EventLog(self.dir / "events.duckdb")  # a new owner: DuckDB replays what was committed
        after = self._event_count()
        assert after in (before, before + len(batch)), "a batch committed in part"
        committed = after == before + len(batch)
        assert committed or not acked, "a commit the owner saw return was lost"
        event(f"owner killed: batch {'committed' if committed else 'lost'}")
        if committed:
            self.commit_staged()
        self.pending, self.staged = [], {}
        self.writer = self._new_writer()  # workers die with their coordinator; segments are never reopened

    @invariant()
    def live_index_is_exactly_the_committed_writes(self):
        rows = {r["sample_id"]: r for r in self.log.samples() if r["state"] in ("written", "verified")}
        assert set(rows) == set(self.expected)
        spans = sorted((r["segment"], r["token_start"], r["token_start"] + r["num_tokens"]) for r in rows.values())
        for a, b in zip(spans, spans[1:], strict=False):
            assert a[0] != b[0] or a[2] <= b[1], "two live samples overlap"
        reader = SegmentReader(self.dir / "data")
        for sid, r in rows.items():
            assert check_location(self.dir / "data", r["segment"], r["token_start"], r["num_tokens"], r["checksums"],
                                  C, reader) is None
            got = reader.read(r["segment"], r["token_start"], r["num_tokens"])
            ids, _mask, aux, final = self.expected[sid]
            assert np.array_equal(got["input_ids"].numpy(), ids)
            assert torch.equal(got["aux_hidden_state"].view(torch.int16), aux.view(torch.int16))
            assert torch.equal(got["hidden_state"].view(torch.int16), final.view(torch.int16))

    def teardown(self):
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestBuildMachine = BuildMachine.TestCase
TestBuildMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
