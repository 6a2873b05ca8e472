"""The local process behind a server's URL, for an engine's identity check: whether the host is this machine,
which process listens on the port (the outermost of a server and its children that hold the socket too), its
command line as the engine parses it, and a relative path of that command line as the process sees it."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

from builder.procfs import ancestors, cmdline, cwd, listening_pids

T = TypeVar("T")


def is_local(host: str) -> bool:
    """The host is this machine (a loopback address, or one this machine can bind)."""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    try:
        addr = socket.getaddrinfo(host, None)[0][4][0]
        if ipaddress.ip_address(addr).is_loopback:
            return True
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
        return True
    except (OSError, ValueError, IndexError):
        return False


def server_process(server: str, parse: Callable[[int, list[str]], T | None], engine: str) -> tuple[int, T] | str:
    """(pid, what `parse(pid, argv)` makes of its command line) of the `engine` server listening at `server`, or
    why it cannot be read (one line). `parse` returns None for a command line that is not such a server."""
    url = urlparse(server)
    host, port = url.hostname or "", url.port
    if not port:
        return f"{server} names no port"
    if not is_local(host):
        return f"{server} is on another host: its command line cannot be read from here"
    pids = sorted(listening_pids(port))
    found = [(p, c) for p in pids if (c := parse(p, cmdline(p) or [])) is not None]
    if not found:
        return (f"the process listening on port {port} (pid {', '.join(map(str, pids))}) is not a {engine} server "
                "command hsbuild can read (a proxy, a container?)" if pids else
                f"no process of this machine's namespace listens on port {port} (a container or another "
                "namespace?)")
    # a server's children may hold its listening socket too: the outermost command is the server's
    mains = [(p, c) for p, c in found if not any(o != p and o in ancestors(p) for o, _ in found)]
    return mains[0]


def in_process_cwd(pid: int, path: str | None) -> str | None:
    """A relative path of a process's command line, as that process sees it (against its working directory)."""
    if path is None or os.path.isabs(path):
        return path
    where = cwd(pid)
    return os.path.join(where, path) if where is not None else path


def same_path(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)
