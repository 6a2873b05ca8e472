"""Prometheus metrics of the command that owns a build (`hsbuild run --metrics HOST:PORT`).

The owner session serves them while it lasts, from the very status that `hsbuild status --json` gets from the
owner (`OwnerSession.status`: answered within STATUS_WAIT_S, from the last figures while the log is stuck), so a
scrape and `status --json` taken at the same moment give the same counts. Names follow Prometheus' conventions
(base units, `_total` for counters, `_ratio` for fractions); every series is documented in docs/runbook.md,
which also holds a scrape configuration.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from builder.errors import UsageError

SAMPLE_STATES = ("pending", "requeued", "started", "written", "verified", "failed", "retired")


class MetricsAddressError(UsageError, OSError):
    """`--metrics` names an address that cannot be served (malformed, or the port is taken)."""


@dataclass(frozen=True)
class MetricsAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(text: str) -> MetricsAddress:
    """`HOST:PORT` (an IPv4 address or a host name, a port 0-65535, 0: any free one; `[::1]:PORT` for IPv6)."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([A-Za-z0-9.-]+):(\d{1,5})", text.strip())
    port = int(m.group(2) or m.group(4)) if m else 0
    if m is None or not 0 <= port < 65536:
        raise MetricsAddressError(f"--metrics {text!r}: give HOST:PORT, e.g. 127.0.0.1:9400 (a port 0-65535; 0: any free one)")
    return MetricsAddress(m.group(1) or m.group(3), port)


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class StatusCollector:
    """Turns one owner status (a dict, as `status --json` prints it while a command runs) into metric families."""

    def __init__(self, status: Callable[[], dict]):
        self.status = status

    def collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily  # noqa: PLC0415

        st = self.status()

        def gauge(name: str, doc: str, value: object, unit: str = "") -> Iterator:
            v = _num(value)
            if v is not None:
                yield GaugeMetricFamily(f"hsbuild_{name}", doc, value=v, unit=unit)

        def by_label(name: str, doc: str, label: str, values: list[tuple[str, object]]):
            fam = GaugeMetricFamily(f"hsbuild_{name}", doc, labels=[label])
            for key, value in values:
                if _num(value) is not None:
                    fam.add_metric([str(key)], float(value))
            return fam

        info = InfoMetricFamily("hsbuild_run", "the command that owns the build")
        info.add_metric([], {"run_id": str(st.get("run_id", "")), "purpose": str(st.get("purpose", "")),
                             "phase": str(st.get("phase", "")), "backend": str(st.get("backend", ""))})
        yield info
        yield from gauge("up", "1 while a command owns the build and answers", 1)
        yield from gauge("status_stale", "1 when these figures are the last the log could give (it is stuck)",
                         1 if st.get("stale") else 0)
        yield from gauge("workers", "extraction workers of the run", st.get("workers"))

        if "total" in st:  # (absent while the owner is still starting: no log open yet)
            yield by_label("samples", "samples of the build by state", "state",
                           [(state, st.get(state)) for state in SAMPLE_STATES])
            yield from gauge("samples_in_build", "samples registered in the build", st.get("total"))
            yield by_label("samples_failed_by_reason", "failed samples by error", "reason",
                           list((st.get("failed_by_reason") or {}).items()))
            yield by_label("responses_at_token_limit", "regenerated responses that stopped at the token limit "
                           "(finish_reason length): kept in the build, or retired (--drop-truncated)", "outcome",
                           [("kept", st.get("at_token_limit")), ("retired", st.get("dropped_at_token_limit"))])
            yield by_label("tokens", "tokens of the build: done (written), todo and total", "state",
                           [("done", st.get("tokens_done")), ("todo", st.get("remaining_tokens")),
                            ("total", st.get("tokens_total"))])
            yield from gauge("written_bytes", "bytes of the written samples as stored: their encoded (compressed) "
                             "chunks, the sum of their written events' nbytes", st.get("bytes_done"))
            yield from gauge("written_disk_bytes", "bytes the written samples take on disk (allocated blocks, with "
                             "their share of the groups' manifests)", st.get("disk_bytes_done"))
            yield from gauge("samples_per_second", "recent throughput (samples written a second)",
                             st.get("recent_samples_per_s"))
            yield from gauge("tokens_per_second", "recent throughput (tokens written a second)",
                             st.get("recent_tokens_per_s"))
            yield from gauge("eta_seconds", "estimated time to the end (absent while paused or unknown)",
                             st.get("eta_seconds"))

        yield from gauge("disk_usage_ratio", "used fraction of the build's volume", st.get("usage"))
        yield from gauge("disk_free_bytes", "free bytes on the build's volume", st.get("free_bytes"))
        yield from gauge("disk_size_bytes", "size of the build's volume", st.get("total_bytes"))
        yield from gauge("projected_bytes", "bytes the samples left are projected to take", st.get("projected_bytes"))
        yield by_label("watermark_ratio", "disk watermarks: writers resume below low, pause at high, never cross "
                       "flood", "level", [(level, st.get(level)) for level in ("low", "high", "flood")])
        yield from gauge("min_free_bytes", "writers pause when free space drops below this", st.get("min_free"))

        paused = GaugeMetricFamily("hsbuild_paused", "1 while writers are paused; the reason as a label",
                                   labels=["reason"])
        paused.add_metric([str(st.get("pause_reason") or "")], 1.0 if st.get("paused") else 0.0)
        yield paused
        stall = st.get("stalled") or {}
        stalled = GaugeMetricFamily("hsbuild_stalled", "1 while a write, fsync or log commit of the build has not "
                                    "returned for HSBUILD_STALL_S", labels=["what", "path", "filesystem"])
        stalled.add_metric([str(stall.get("what", "")), str(stall.get("path", "")), str(stall.get("filesystem", ""))],
                           1.0 if stall else 0.0)
        yield stalled
        if stall:
            yield from gauge("stalled_seconds", "how long the stalled operation has been pending",
                             stall.get("pending_s"))

        if "server" in st:  # an engine backend (an inference server)
            up = GaugeMetricFamily("hsbuild_engine_up", "1 while the inference server answers",
                                   labels=["backend", "server"])
            up.add_metric([str(st.get("backend", "")), str(st.get("server", ""))],
                          1.0 if st.get("server_healthy") else 0.0)
            yield up
            yield from gauge("engine_restarts", "times hsbuild restarted the server (--launch)",
                             st.get("server_restarts"))
            yield from gauge("engine_in_flight", "requests sent to the server, not yet ingested", st.get("in_flight"))
            yield from gauge("staging_files", "files in the build's staging folder", st.get("staging_files"))
            yield from gauge("staging_bytes", "bytes in the build's staging folder", st.get("staging_bytes"))

        nodes = st.get("nodes") or []
        if nodes:  # a run on Ray: per node
            fams = {key: GaugeMetricFamily(f"hsbuild_node_{name}", doc, labels=["node", "host"])
                    for key, name, doc in (("workers", "workers", "workers placed on the node"),
                                           ("workers_lost", "workers_lost", "the node's workers lost"),
                                           ("written", "samples_written", "samples the node's workers wrote"),
                                           ("tokens", "tokens_written", "tokens the node's workers wrote"),
                                           ("nbytes", "written_bytes", "bytes the node's workers wrote "
                                            "(encoded, compressed: their written events' nbytes)"),
                                           ("samples_per_s", "samples_per_second", "the node's throughput"))}
            for n in nodes:
                for key, fam in fams.items():
                    if _num(n.get(key)) is not None:
                        fam.add_metric([str(n.get("node", "")), str(n.get("host", ""))], float(n[key]))
            yield from fams.values()


class MetricsServer:
    """An HTTP server answering Prometheus scrapes (GET /metrics) from `status`, in a daemon thread."""

    def __init__(self, address: MetricsAddress | str, status: Callable[[], dict]):
        self.address = parse_address(address) if isinstance(address, str) else address
        self.status = status
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(self.status))
        try:
            self._server, self._thread = start_http_server(self.address.port, self.address.host, registry)
        except OSError as e:
            raise MetricsAddressError(f"--metrics {self.address}: cannot serve there ({e.strerror or e}); pick a "
                                      "free port or an address of this machine") from e
        return self

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server is not None else self.address.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
