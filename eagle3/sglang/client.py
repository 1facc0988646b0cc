"""A small HTTP client for running SGLang servers (stdlib only: urllib + a thread pool).

A `ServerPool` is a list of data-parallel servers of one kind; requests are spread round-robin
and kept in flight by the caller's thread pool. Only three endpoints are used:
`GET /get_server_info` (version and server args), `POST /generate` and `POST /flush_cache`.
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any


class SGLangError(RuntimeError):
    """A server could not be reached or answered something unusable; the message names the server."""


class ServerUnavailable(SGLangError):
    """The server at `url` is down, restarting or overloaded (no answer, or HTTP 5xx): worth
    waiting for, unlike an answer that is wrong."""

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


def _server_of(endpoint: str) -> str:
    return endpoint.rsplit("/", 1)[0]


def _call(url: str, body: dict | None, timeout: float, expect_json: bool = True) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read()[:300].decode(errors="replace")
        message = f"{url} answered HTTP {err.code}: {detail}"
        if err.code >= 500:  # overloaded or restarting: worth waiting for
            raise ServerUnavailable(message, _server_of(url)) from None
        raise SGLangError(message) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ServerUnavailable(f"cannot reach {url}: {reason}", _server_of(url)) from None
    if not expect_json:
        return raw
    try:
        return json.loads(raw) if raw.strip() else None
    except json.JSONDecodeError:
        raise SGLangError(f"{url} answered something that is not JSON: {raw[:200]!r}") from None


@dataclass
class ServerPool:
    """Data-parallel SGLang servers serving the same target in the same mode."""

    urls: list[str]
    timeout_s: float = 600.0
    _next: itertools.count = field(default_factory=itertools.count, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a server pool needs at least one URL")
        self.urls = [u.rstrip("/") for u in self.urls]

    def pick(self) -> str:
        """The next server, round-robin (thread-safe)."""
        with self._lock:
            return self.urls[next(self._next) % len(self.urls)]

    def server_info(self, url: str) -> dict:
        info = _call(f"{url}/get_server_info", None, self.timeout_s)
        if not isinstance(info, dict):
            raise SGLangError(f"{url}/get_server_info did not answer a JSON object")
        return info

    def generate(self, url: str, body: dict) -> dict:
        response = _call(f"{url}/generate", body, self.timeout_s)
        if not isinstance(response, dict) or "meta_info" not in response:
            raise SGLangError(f"{url}/generate answered without meta_info: {str(response)[:200]}")
        return response

    def flush_cache(self, url: str) -> None:
        # SGLang answers /flush_cache with plain text
        _call(f"{url}/flush_cache", {}, self.timeout_s, expect_json=False)
