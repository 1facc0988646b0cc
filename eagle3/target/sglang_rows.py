"""SGLang hidden-state responses -> rows aligned with input positions (SGLang 0.5.23 layout).

`meta_info.hidden_states` holds one entry per forward pass of the request (recorded in
tests/fixtures/sglang/README.md):
  entry 0   prefill, [rows][W]: row i = input position i, every position, no shift, but only
            the positions the prefix cache did not hold (`cached_tokens` > 0 returns fewer);
  entry k   decode step k >= 1, a bare [W] row at position prompt_len + k - 1, whose input
            token is output_ids[k - 1]; N output tokens give 1 + (N - 1) entries.
W is 3H in aux mode (layers in the order of --return-aux-hidden-state-layer-ids) and H in the
plain mode (the final-norm state). Rows that do not cover the whole prompt are never returned
as if they did: they raise PartialPrefillError, and `request_rows` flushes and asks again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from eagle3.target.sglang_client import ServerPool, SGLangError

# Flushes and re-requests before a prefix-cache hit is reported as an error.
CACHE_HIT_RETRIES = 3


class PartialPrefillError(SGLangError):
    """The server answered rows for only part of the prompt (a prefix-cache hit)."""


@dataclass
class Rows:
    prefill: Tensor  # float32 [P, W], row i = input position i
    decode: Tensor  # float32 [N - 1, W], row j = position P + j (input token output_ids[j])
    output_ids: list[int]


def prefill_body(input_ids: list[int]) -> dict:
    """A prefill-only request: one new token is the least SGLang computes states for."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_hidden_states": True,
    }


def generate_body(
    input_ids: list[int], max_new_tokens: int, stop_ids: list[int], ignore_eos: bool = False
) -> dict:
    """Greedy generation whose decode steps return their rows too."""
    sampling: dict = {"max_new_tokens": max_new_tokens, "temperature": 0}
    if ignore_eos:
        sampling["ignore_eos"] = True
    elif stop_ids:
        sampling["stop_token_ids"] = sorted(stop_ids)
    return {"input_ids": list(input_ids), "sampling_params": sampling, "return_hidden_states": True}


def _matrix(rows: object, width: int, what: str, url: str) -> np.ndarray:
    array = np.asarray(rows, dtype=np.float32)
    if array.ndim == 1 and array.size == 0:
        array = array.reshape(0, width)
    if array.ndim != 2 or array.shape[1] != width:
        raise SGLangError(
            f"{url}: hidden-state rows have shape {list(array.shape)}, expected [n, {width}] ({what})"
        )
    return array


def parse_rows(response: dict, prompt_len: int, width: int, what: str, url: str = "server") -> Rows:
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
    return Rows(torch.from_numpy(prefill), torch.from_numpy(decode), output_ids)


def request_rows(pool: ServerPool, body: dict, width: int, what: str) -> Rows:
    """Send `body` to the next server of `pool`; on a prefix-cache hit flush that server's cache
    and ask again, so that rows are never stored short."""
    url = pool.pick()
    for _ in range(CACHE_HIT_RETRIES):
        try:
            return parse_rows(pool.generate(url, body), len(body["input_ids"]), width, what, url)
        except PartialPrefillError as err:
            last = err
            pool.flush_cache(url)
    raise PartialPrefillError(
        f"{last}; still after {CACHE_HIT_RETRIES} cache flushes: launch the extraction servers "
        "with --disable-radix-cache"
    )
