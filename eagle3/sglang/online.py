"""Online features from SGLang servers: the trainer is an HTTP client of the extraction servers.

Each training batch's samples are sent one request each (the same requests extraction sends,
eagle3/sglang/features.py `text_sample`), spread round-robin over extract.sglang_url's
data-parallel servers, extract.sglang_requests_in_flight at a time. Under torchrun each rank
asks only for its own rows. The servers are checked against the patch-check report before the
first request. A server that stops answering (killed, restarting) is waited for: one line names
it, training resumes when it answers again with the args patch-check recorded, and a server
relaunched with other args is refused, as extract refuses it. The sampled re-check sends a
sample again (to the next server) and compares the two answers.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rich.console import Console
from rich.markup import escape

from eagle3.core.params import Params
from eagle3.data.store import FeatureStore, Sample
from eagle3.sglang.client import ServerUnavailable
from eagle3.sglang.features import CheckedServers, checked_servers, text_sample
from eagle3.target.render import Rendered
from eagle3.train.online import OnlineFeed, Recheck

# How often a server that stopped answering is asked again (EAGLE3_SGLANG_POLL_S overrides it).
POLL_S = float(os.environ.get("EAGLE3_SGLANG_POLL_S", "5"))
WAIT_S = 3600.0  # how long one server may stay away before training stops (nothing is lost)

R = TypeVar("R")


def sglang_features(params: Params, store: FeatureStore) -> OnlineFeed:
    """The online store's features from the servers patch-check checked: their rows, the re-check
    (another request), and N of the top-N the store's target mode gives (None: final-norm states)."""
    fingerprint = store.fingerprint
    if fingerprint.engine != "sglang":
        raise ValueError(
            "extract.backend is 'sglang' but the online store was checked on "
            f"{fingerprint.engine}: run patch-check and extract again"
        )
    checked = checked_servers(params, fingerprint)
    if checked.aux_layers != store.aux_layers:
        raise ValueError(
            f"the servers capture layers {checked.aux_layers}, the store was made for {store.aux_layers}"
        )
    in_flight = params.extract.sglang_requests_in_flight

    def one(rendered: Rendered) -> Sample:
        return patiently(lambda: text_sample(checked.servers, checked.hidden_size, rendered), checked)

    def compute(rendered: list[Rendered]) -> list[Sample]:
        with ThreadPoolExecutor(min(in_flight, max(1, len(rendered)))) as pool:
            return list(pool.map(one, rendered))

    urls = ", ".join(checked.servers.aux.urls)
    recheck = Recheck(params.online.recheck_every, one, f"another request to the servers ({urls})")
    return OnlineFeed(compute, recheck, target_topk=checked.servers.top_logprobs)


def patiently(
    request: Callable[[], R], checked: CheckedServers, poll_s: float = POLL_S, wait_s: float = WAIT_S
) -> R:
    """`request()`, waiting out servers that stop answering: each is named in one line, asked
    every `poll_s` seconds, refused if it comes back with other args than patch-check recorded."""
    while True:
        try:
            return request()
        except ServerUnavailable as err:
            wait_for(err.url, str(err), checked, poll_s, wait_s)


def wait_for(url: str, why: str, checked: CheckedServers, poll_s: float, wait_s: float) -> None:
    """Return once `url` answers again with the recorded args; raise after `wait_s` seconds.
    One thread waits at a time, so the requests in flight to a dead server print one line."""
    with _WAITING:
        try:
            checked.refuse_changed(url)
            return  # back already (another request's wait saw it return)
        except ServerUnavailable:
            pass
        _wait(url, why, checked, poll_s, wait_s)


_WAITING = threading.Lock()


def _wait(url: str, why: str, checked: CheckedServers, poll_s: float, wait_s: float) -> None:
    Console(stderr=True).print(
        f"[yellow]train:[/] {escape(why)}; waiting for {escape(url)} (retrying every {poll_s:g} s)",
        soft_wrap=True,
    )
    deadline = time.monotonic() + wait_s
    while True:
        time.sleep(poll_s)
        try:
            checked.refuse_changed(url)  # answers, with the args patch-check saw
        except ServerUnavailable:
            if time.monotonic() > deadline:
                raise ServerUnavailable(
                    f"{url} has not answered for {wait_s:g} s; training stopped after its last "
                    "checkpoint: start the server and run the train stage again (it resumes)",
                    url,
                ) from None
            continue
        Console(stderr=True).print(f"[green]train:[/] {escape(url)} answers again; resuming", soft_wrap=True)
        return
