"""SGLang hidden-state responses -> rows aligned with input positions (SGLang 0.5.23 layout).

`meta_info.hidden_states` holds one entry per forward pass of the request (recorded in
tests/fixtures/sglang/README.md):
  entry 0   prefill, [rows][W]: row i = input position i, every position, no shift, but only
            the positions the prefix cache did not hold (`cached_tokens` > 0 returns fewer);
  entry k   decode step k >= 1, a bare [W] row at position prompt_len + k - 1, whose input
            token is output_ids[k - 1]; N output tokens give 1 + (N - 1) entries.
W is 3H in aux mode (layers in the order of --return-aux-hidden-state-layer-ids) and H in the
plain mode (the final-norm state). Rows that do not cover the whole prompt are never returned
as if they did: a prefix-cache hit raises PartialPrefillError, and `request_rows` flushes and
asks again; a chunked prefill (SGLang keeps its last chunk's rows only) is refused by name.

With `top_logprobs` (return_logprob, logprob_start_len 0, top_logprobs_num N) the same request
carries the target's top-N next tokens, as [logprob, token id, text] triples per position:
  meta_info.input_top_logprobs[i]   predicts input token i from the tokens before it (entry 0,
                                    with nothing before it, is None), one entry per prompt token;
  meta_info.output_top_logprobs[k]  predicts output_ids[k].
Stored like last_hidden, row t is the prediction of token t + 1: input entry t + 1 within the
prompt, then output entry t - P + 1 from the last prompt position P - 1 on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from eagle3.sglang.client import ServerPool, SGLangError

# Flushes and re-requests before a prefix-cache hit is reported as an error.
CACHE_HIT_RETRIES = 3
# SGLang 0.5.23 may answer a request a moment before its scheduler counts it finished, and then
# refuses a flush as if other requests ran ("pending requests. #queue-req: 0, #running-req: 0",
# seen live with one request in flight): waits before each further try.
FLUSH_WAITS_S = (0.05, 0.25, 1.0)


class PartialPrefillError(SGLangError):
    """The server answered rows for only part of the prompt (a prefix-cache hit)."""


@dataclass
class Rows:
    prefill: Tensor  # float32 [P, W], row i = input position i
    decode: Tensor  # float32 [N - 1, W], row j = position P + j (input token output_ids[j])
    output_ids: list[int]
    # with top logprobs: [P + N - 1, n], row t = the target's top-n prediction of token t + 1
    top_ids: Tensor | None = None  # int32
    top_logprobs: Tensor | None = None  # float32, best first


def logprob_fields(top_logprobs: int | None) -> dict:
    """What asks SGLang for the top-N logprobs at every input position (none when None)."""
    if not top_logprobs:
        return {}
    return {
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": top_logprobs,
        "return_text_in_logprobs": False,
    }


def prefill_body(input_ids: list[int], top_logprobs: int | None = None) -> dict:
    """A prefill-only request: one new token is the least SGLang computes states for."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_hidden_states": True,
    } | logprob_fields(top_logprobs)


def generate_body(
    input_ids: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    ignore_eos: bool = False,
    top_logprobs: int | None = None,
) -> dict:
    """Greedy generation whose decode steps return their rows too."""
    sampling: dict = {"max_new_tokens": max_new_tokens, "temperature": 0}
    if ignore_eos:
        sampling["ignore_eos"] = True
    elif stop_ids:
        sampling["stop_token_ids"] = sorted(stop_ids)
    body = {"input_ids": list(input_ids), "sampling_params": sampling, "return_hidden_states": True}
    return body | logprob_fields(top_logprobs)


def _matrix(rows: object, width: int, what: str, url: str) -> np.ndarray:
    array = np.asarray(rows, dtype=np.float32)
    if array.ndim == 1 and array.size == 0:
        array = array.reshape(0, width)
    if array.ndim != 2 or array.shape[1] != width:
        raise SGLangError(
            f"{url}: hidden-state rows have shape {list(array.shape)}, expected [n, {width}] ({what})"
        )
    return array


def _top_entries(entries: list, n: int, where: str, url: str) -> tuple[np.ndarray, np.ndarray]:
    """[len, n] ids and logprobs from SGLang's [logprob, id, text] triples, best first."""
    ids = np.zeros((len(entries), n), dtype=np.int32)
    logprobs = np.zeros((len(entries), n), dtype=np.float32)
    for row, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != n:
            got = len(entry) if isinstance(entry, list) else type(entry).__name__
            raise SGLangError(f"{url}: {where}[{row}] holds {got} top logprobs, expected {n}")
        try:
            logprobs[row] = [float(t[0]) for t in entry]
            ids[row] = [int(t[1]) for t in entry]
        except (TypeError, ValueError, IndexError):
            raise SGLangError(f"{url}: {where}[{row}] is not a list of [logprob, id, text]") from None
    return ids, logprobs


def parse_top(response: dict, prompt_len: int, n: int, url: str = "server") -> tuple[Tensor, Tensor]:
    """(ids int32, logprobs float32), each [P + N - 1, n]: row t = the top-n prediction of token t + 1."""
    meta = response.get("meta_info", {})
    given, made = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
    if given is None or made is None:
        raise SGLangError(
            f"{url}: the response has no meta_info.input_top_logprobs / output_top_logprobs: send "
            "return_logprob: true, logprob_start_len: 0 and top_logprobs_num"
        )
    if len(given) != prompt_len:
        raise PartialPrefillError(
            f"{url}: top logprobs for {len(given)} of {prompt_len} prompt positions "
            f"({meta.get('cached_tokens') or 0} cached tokens)"
        )
    outputs = len(response.get("output_ids") or [])
    if len(made) != outputs or outputs == 0:
        raise SGLangError(f"{url}: {len(made)} output top-logprob entries for {outputs} output tokens")
    # input entry 0 predicts nothing; output entry k predicts output_ids[k] from position P + k - 1
    ids, logprobs = _top_entries(list(given[1:]) + list(made), n, "top logprobs", url)
    return torch.from_numpy(ids), torch.from_numpy(logprobs)


def parse_rows(
    response: dict,
    prompt_len: int,
    width: int,
    what: str,
    url: str = "server",
    top_logprobs: int | None = None,
) -> Rows:
    """Position-aligned rows of one /generate response; raise on anything short or misshapen."""
    meta = response.get("meta_info", {})
    states = meta.get("hidden_states")
    if not states:
        raise SGLangError(
            f"{url}: the response has no meta_info.hidden_states; launch the server with "
            "--enable-return-hidden-states and send return_hidden_states: true"
        )
    prefill = _matrix(states[0], width, what, url)
    cached = int(meta.get("cached_tokens") or 0)
    if cached == 0 and prefill.shape[0] < prompt_len:
        # SGLang 0.5.23 keeps the rows of a chunked prefill's last chunk only: no flush helps
        raise SGLangError(
            f"{url}: rows for {prefill.shape[0]} of {prompt_len} prompt positions and no cached "
            "tokens: the server split the prompt into chunked prefills (--chunked-prefill-size), "
            "whose JSON rows SGLang returns for the last chunk only; raise --chunked-prefill-size "
            "above the longest sample (data.max_length), or use extract.sglang_transport: hook"
        )
    if cached > 0 or prefill.shape[0] != prompt_len:
        raise PartialPrefillError(
            f"{url}: prefix-cache hit: rows for {prefill.shape[0]} of {prompt_len} prompt positions "
            f"({cached} cached tokens)"
        )
    steps = [np.asarray(s, dtype=np.float32).reshape(-1) for s in states[1:]]
    decode = _matrix(np.stack(steps) if steps else np.zeros((0, width)), width, what, url)
    output_ids = [int(i) for i in response.get("output_ids") or []]
    if output_ids and len(steps) != len(output_ids) - 1:
        raise SGLangError(
            f"{url}: {len(steps)} decode rows for {len(output_ids)} output tokens (expected one fewer)"
        )
    rows = Rows(torch.from_numpy(prefill), torch.from_numpy(decode), output_ids)
    if top_logprobs:
        rows.top_ids, rows.top_logprobs = parse_top(response, prompt_len, top_logprobs, url)
    return rows


def with_cache_retries(pool: ServerPool, once: Callable[[str], Rows]) -> Rows:
    """`once(url)` on the next server of `pool`; on a prefix-cache hit flush that server's cache
    and ask again, so that rows are never stored short (either transport)."""
    url = pool.pick()
    for _ in range(CACHE_HIT_RETRIES):
        try:
            return once(url)
        except PartialPrefillError as err:
            last = err
            try:
                _flush(pool, url)
            except SGLangError as refused:  # SGLang 0.5.23 flushes only an idle server (HTTP 400)
                raise PartialPrefillError(
                    f"{err}, and the server refused to flush its cache ({refused}): it flushes only "
                    "when idle; launch the extraction servers with --disable-radix-cache"
                ) from None
    raise PartialPrefillError(
        f"{last}; still after {CACHE_HIT_RETRIES} cache flushes: launch the extraction servers "
        "with --disable-radix-cache"
    )


def _flush(pool: ServerPool, url: str) -> None:
    """Flush `url`'s cache, trying again after each of FLUSH_WAITS_S while it says it is busy."""
    for wait in FLUSH_WAITS_S:
        try:
            return pool.flush_cache(url)
        except SGLangError:
            time.sleep(wait)
    pool.flush_cache(url)


def request_rows(pool: ServerPool, body: dict, width: int, what: str) -> Rows:
    """Send `body` to the next server of `pool` and parse the rows of its JSON reply."""
    top, n = body.get("top_logprobs_num"), len(body["input_ids"])

    def once(url: str) -> Rows:
        return parse_rows(pool.generate(url, body), n, width, what, url, top)

    return with_cache_retries(pool, once)


class JsonTransport:
    """Rows as JSON numbers in the /generate reply (return_hidden_states): the reference path,
    and the only one that carries decode rows (on-policy generation)."""

    name = "json"

    def request_rows(self, pool: ServerPool, body: dict, width: int, what: str) -> Rows:
        return request_rows(pool, body, width, what)


JSON = JsonTransport()
