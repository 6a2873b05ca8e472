"""How hsbuild reads an inference server's answers, against a real socket server on 127.0.0.1 that misbehaves
the ways a dying server does. A server killed mid-reply (headers sent, body not; or half a status line) is the
engine's failure: the sample goes back to pending (`EngineUnavailable`), never failed for good. Before, such a
cut-short answer raised http.client's own errors and the sample was failed as `error` (the run exited 1)."""

from __future__ import annotations

import socket
import threading

import pytest

from builder.extract.backends.http_client import EngineRejected, EngineUnavailable, complete, healthy


def _whole_request(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return len(body) >= length


def _serve_once(reply: bytes) -> tuple[str, threading.Thread]:
    """A server that reads one request, sends `reply` (bytes as they are) and closes the connection."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(30)

    def run() -> None:
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(10)
                data = b""
                while not _whole_request(data):  # all of it: unread bytes at close would reset the connection
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                conn.sendall(reply)
        finally:
            srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", t


CUT_SHORT = {
    "headers sent, body cut": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"id\"",
    "half a status line": b"HTTP/1.1 2",
    "headers cut": b"HTTP/1.1 200 OK\r\nContent-Ty",
    "an error page cut": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nbus",
    "closed at once": b"",
}


@pytest.mark.parametrize("case", sorted(CUT_SHORT))
def test_an_answer_cut_short_is_the_engine_being_unavailable(case):
    url, t = _serve_once(CUT_SHORT[case])
    with pytest.raises(EngineUnavailable, match=r"127\.0\.0\.1"):
        complete(url, "m", [1, 2, 3], timeout=10)
    t.join(10)


def test_a_4xx_is_the_request_rejected_and_a_whole_answer_is_read():
    url, t = _serve_once(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\nprompt: wrong")
    with pytest.raises(EngineRejected, match="HTTP 400: prompt: wrong"):
        complete(url, "m", [1], timeout=10)
    t.join(10)
    body = b'{"choices": [{"text": "x"}]}'
    url, t = _serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert complete(url, "m", [1], timeout=10) == {"choices": [{"text": "x"}]}
    t.join(10)


def test_health_of_a_server_that_dies_mid_reply_is_false_not_an_error():
    url, t = _serve_once(CUT_SHORT["headers sent, body cut"])
    assert healthy(url) is False
    t.join(10)


@pytest.mark.parametrize("code,kind", [(400, EngineRejected), (413, EngineRejected), (422, EngineRejected),
                                       (404, EngineUnavailable), (401, EngineUnavailable), (429, EngineUnavailable),
                                       (500, EngineUnavailable), (503, EngineUnavailable)])
def test_only_a_request_fault_is_the_samples(code, kind):
    """A 4xx that is not about the request (404: a server restarted under another model name answers `The model
    ... does not exist` for every request; 401; 429) is the server's: the sample goes back to pending instead of
    every sample failing as its own fault."""
    text = b'{"message": "The model `m` does not exist."}'
    url, t = _serve_once(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (code, len(text), text))
    with pytest.raises(kind, match=f"HTTP {code}"):
        complete(url, "m", [1], timeout=10)
    t.join(10)
