"""Talking to an inference server over HTTP (stdlib only): health, the served model, one completion.

Errors are typed: `EngineUnavailable` (cannot connect, timed out, 5xx, an answer cut short, or a 4xx that is not
about the request: an unknown model name, a missing endpoint, auth, too many requests; the engine is gone, busy or
not the one expected, the sample goes back to pending) and `EngineRejected` (400, 413, 422: this request is wrong,
the sample fails)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass


class EngineUnavailable(ConnectionError):
    """The server cannot be reached, timed out, or answered 5xx."""


class ServerRefused(ConnectionError):
    """The server is not the one the build needs (another model, other layers, another staging folder): nothing
    it returns may be stored. The message names both sides."""


class EngineRejected(ValueError):
    """The server refused this request (400, 413, 422: the request itself is wrong)."""


# 4xx codes that are about the request (its prompt too long, malformed): the sample's fault. Any other 4xx (404:
# the model name is not served, or no such endpoint; 401/403; 429) is the server's, never the sample's.
REQUEST_FAULTS = (400, 413, 422)


@dataclass(frozen=True)
class ServedModel:
    id: str  # the name requests use
    root: str  # the path or repo it was loaded from
    max_model_len: int | None


def _call(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        try:
            text = e.read().decode(errors="replace")[:300]
        except (http.client.HTTPException, OSError):  # its error page cut short
            text = ""
        if e.code >= 500 or e.code not in REQUEST_FAULTS:
            raise EngineUnavailable(f"{url}: HTTP {e.code}: {text}") from None
        raise EngineRejected(f"{url}: HTTP {e.code}: {text}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EngineUnavailable(f"{url}: {reason}") from None
    except http.client.HTTPException as e:  # its answer cut short (IncompleteRead, BadStatusLine): it died mid-reply
        raise EngineUnavailable(f"{url}: the answer was cut short ({type(e).__name__}: {e})") from None
    if not raw and body is not None:  # a completion always has a body: the connection closed before it came
        raise EngineUnavailable(f"{url}: answered with an empty body (the server died mid-reply?)")
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        raise EngineUnavailable(f"{url}: answered something that is not JSON") from None


def healthy(server: str, timeout: float = 2.0) -> bool:
    try:
        _call(server.rstrip("/") + "/health", None, timeout)
        return True
    except (EngineUnavailable, EngineRejected):
        return False


def served_model(server: str, timeout: float = 10.0) -> ServedModel:
    doc = _call(server.rstrip("/") + "/v1/models", None, timeout)
    models = doc.get("data") or []
    if not models:
        raise EngineUnavailable(f"{server}/v1/models: the server lists no model")
    m = models[0]
    return ServedModel(str(m.get("id")), str(m.get("root") or m.get("id")), m.get("max_model_len"))


def complete(server: str, model: str, token_ids: list[int], timeout: float,
             kv_transfer_params: dict | None = None) -> dict:
    """One prefill: `max_tokens` 1, the prompt given as token ids (`kv_transfer_params`: for the server's KV
    connector, e.g. where its hidden-states file goes). Returns the response document."""
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    return completion(server, body, timeout)


def completion(server: str, body: dict, timeout: float) -> dict:
    """One `/v1/completions` request with the body as given (an engine's own parameters). Returns the response
    document."""
    return _call(server.rstrip("/") + "/v1/completions", body, timeout)
