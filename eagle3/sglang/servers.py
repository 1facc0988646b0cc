"""The SGLang servers an extraction reads, and which target mode is in use: one value, built
from the extract params here and nowhere else.

The aux mode (extract.sglang_url) returns no final-norm state, so the target's own next-token
prediction, which training distils, comes either
  * TopLogprobs(n) (extract.sglang_target: top_logprobs, n = sglang_top_logprobs): from the same
    aux request, the target's top-n next tokens and logprobs at every position, stored in place
    of last_hidden; or
  * FinalState(pool) (sglang_target: final_state, pool = sglang_final_url): from a second
    request to plain-mode servers of the same target, the final-norm rows [T, H], recomputed
    into logits with the lm_head as for the hf backend (a second prefill: twice the server work).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.core.params import ExtractParams
from eagle3.sglang.client import ServerPool
from eagle3.sglang.handover import HookTransport
from eagle3.sglang.rows import JSON, JsonTransport


@dataclass(frozen=True)
class TopLogprobs:
    n: int

    def describe(self) -> str:
        return f"top {self.n} logprobs"


@dataclass(frozen=True)
class FinalState:
    pool: ServerPool

    def describe(self) -> str:
        return "final-norm states"


def store_format(extract: ExtractParams) -> str:
    """What the feature store holds of the target's prediction under these params: the top-N
    logprobs (top_logprobs) or the final-norm state (final_state: also every hf extraction)."""
    if extract.backend == "sglang" and extract.sglang_target == "top_logprobs":
        return "top_logprobs"
    return "final_state"


def _listed(urls: str | list[str] | None) -> list[str]:
    return [urls] if isinstance(urls, str) else list(urls or [])


@dataclass(frozen=True)
class ExtractionServers:
    aux: ServerPool
    mode: TopLogprobs | FinalState
    transport: JsonTransport | HookTransport = JSON  # how the aux rows travel

    @classmethod
    def from_params(cls, extract: ExtractParams) -> ExtractionServers:
        """The servers of extract.sglang_url, the mode of extract.sglang_target and the transport
        of extract.sglang_transport (the params validator has checked that sglang_final_url is
        given exactly for final_state, and a hand-over folder exactly for the hook)."""
        aux = ServerPool(_listed(extract.sglang_url))
        transport = JSON
        if extract.sglang_transport == "hook":
            transport = HookTransport(extract.sglang_handover_dir)  # refuses an unusable folder
        if extract.sglang_target == "final_state":
            return cls(aux, FinalState(ServerPool(_listed(extract.sglang_final_url))), transport)
        return cls(aux, TopLogprobs(extract.sglang_top_logprobs), transport)

    @property
    def top_logprobs(self) -> int | None:
        """N of the top-N logprobs every aux request asks for (and the store holds), or None."""
        return self.mode.n if isinstance(self.mode, TopLogprobs) else None

    @property
    def final(self) -> ServerPool | None:
        """The final-state servers, or None when the top logprobs replace them."""
        return self.mode.pool if isinstance(self.mode, FinalState) else None
