"""What extraction and online training share on SGLang servers: the servers checked against the
patch-check report, and one text sample's features (the aux rows, and the target's prediction as
the target mode gives it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.core.layer_ids import LayerIdRule, layer_id_rule
from eagle3.core.params import Params, check_against_target
from eagle3.data.store import Sample
from eagle3.sglang.check import check_pools
from eagle3.sglang.client import ServerPool
from eagle3.sglang.rows import Rows, prefill_body, request_rows
from eagle3.sglang.server_args import check_pool_args
from eagle3.sglang.servers import ExtractionServers, FinalState
from eagle3.target.fingerprint import Fingerprint
from eagle3.target.load import load_target_config
from eagle3.target.render import Rendered


def target_of(servers: ExtractionServers, hidden: int, rows: Rows, ids: list[int]) -> dict:
    """The sample's target fields for its first len(ids) positions: the top-N that came with
    `rows`, or (final-state mode) the final-norm rows of one prefill of `ids` on its servers."""
    if not isinstance(servers.mode, FinalState):
        n = len(ids)
        return {
            "target_topk_ids": rows.top_ids[:n].clone(),
            "target_topk_logprobs": rows.top_logprobs[:n].clone(),
        }
    last = request_rows(servers.mode.pool, prefill_body(ids), hidden, "final-norm rows, hidden_size").prefill
    return {"last_hidden": last.to(torch.bfloat16)}


def text_sample(servers: ExtractionServers, hidden: int, rendered: Rendered) -> Sample:
    ids = rendered.input_ids.tolist()
    body = prefill_body(ids, servers.top_logprobs)
    rows = servers.transport.request_rows(servers.aux, body, 3 * hidden, "aux rows, 3 x hidden_size")
    return Sample(
        input_ids=torch.from_numpy(rendered.input_ids.copy()),
        loss_mask=torch.from_numpy(rendered.loss_mask.copy()),
        aux_hidden=rows.prefill.to(torch.bfloat16),
        **target_of(servers, hidden, rows, ids),
    )


def refuse_concurrent_cache_hits(aux: ServerPool, final: ServerPool, in_flight: int) -> None:
    """final_state requests ask for no logprobs, so a prompt prefix the server saw before (a
    chat template's system prompt) hits its radix cache and comes back short. The client then
    flushes and asks again, but SGLang 0.5.23 flushes only an idle server (HTTP 400 while other
    requests run; recorded by tests/test_sglang_live.py): refuse that before any request."""
    cached = [
        url
        for pool in (aux, final)
        for url in pool.urls
        if not pool.server_info(url).get("disable_radix_cache")
    ]
    if cached:
        raise ValueError(
            f"sglang_target final_state with sglang_requests_in_flight {in_flight}: {', '.join(cached)} "
            "run with the radix cache on, and SGLang cannot flush a cache hit while other requests "
            "run: launch them with --disable-radix-cache, or set sglang_requests_in_flight: 1 "
            "(or use sglang_target: top_logprobs, whose requests never hit the cache)"
        )


@dataclass(frozen=True)
class CheckedServers:
    """The servers of the extract params, checked against what patch-check recorded."""

    servers: ExtractionServers
    aux_layers: list[int]
    hidden_size: int
    rule: LayerIdRule
    recorded: dict  # name ("server_args", "final_server_args") -> the args patch-check saw

    def refuse_changed(self, url: str) -> None:
        """ValueError when the server at `url` (relaunched, say) runs other args than recorded."""
        kind = "final" if self.servers.final is not None and url in self.servers.final.urls else "aux"
        pool = self.servers.final if kind == "final" else self.servers.aux
        live = check_pool_args({url: pool.server_info(url)}, kind, self.aux_layers, self.rule)
        _refuse_changed(self.recorded["final_server_args" if kind == "final" else "server_args"], live)


def _refuse_changed(recorded: dict | None, live: dict) -> None:
    recorded = recorded or {}
    changed = sorted(k for k in live if recorded.get(k) != live[k])
    if changed:
        detail = ", ".join(f"{k}: {recorded.get(k)!r} -> {live[k]!r}" for k in changed)
        raise ValueError(f"the SGLang servers changed since patch-check ({detail}): run patch-check again")


def checked_servers(params: Params, fingerprint: Fingerprint) -> CheckedServers:
    """The extract params' servers after refusing, before any request, what differs from the
    patch-check report: the engine, the aux layers, the target mode and every server's args."""
    served = fingerprint.servers
    if fingerprint.engine != "sglang" or served is None:
        raise ValueError(
            f"extract.backend is 'sglang' but the patch-check report checked {fingerprint.engine}: "
            "run patch-check again"
        )
    full_config = load_target_config(params.target)
    config = full_config.get_text_config()  # Kimi-K2.5 nests it
    aux_layers = check_against_target(params, config.num_hidden_layers, config.vocab_size)
    if aux_layers != list(fingerprint.aux_layers):
        raise ValueError(
            f"extract.aux_layers resolve to {aux_layers} but patch-check checked "
            f"{list(fingerprint.aux_layers)}: run patch-check again"
        )
    servers = ExtractionServers.from_params(params.extract)
    if served.target_top_logprobs != servers.top_logprobs:
        checked = served.target_top_logprobs
        raise ValueError(
            f"extract asks for the target's {servers.mode.describe()}, but "
            f"patch-check checked {f'top {checked} logprobs' if checked else 'final-norm states'}: "
            "run patch-check again"
        )
    rule = layer_id_rule(full_config.architectures[0])
    aux_args, final_args = check_pools(servers.aux, servers.final, aux_layers, rule)
    recorded = {"server_args": served.server_args, "final_server_args": served.final_server_args}
    _refuse_changed(recorded["server_args"], aux_args)
    _refuse_changed(recorded["final_server_args"], final_args or {})
    if servers.final is not None and params.extract.sglang_requests_in_flight > 1:
        refuse_concurrent_cache_hits(servers.aux, servers.final, params.extract.sglang_requests_in_flight)
    return CheckedServers(servers, aux_layers, config.hidden_size, rule, recorded)
