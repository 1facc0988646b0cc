"""The SGLang builds this project supports and the server args extraction checks: the mode a
server runs in (aux hidden states of the right layers, or the plain final-norm state) and the
args that change what comes back, recorded in the fingerprint."""

from __future__ import annotations

from eagle3.core.layer_ids import LayerIdRule

# Versions whose response layout was recorded (tests/fixtures/sglang).
SUPPORTED_VERSIONS = ("0.5.23",)
# Server args that change the numbers or the layout of what comes back; recorded in the
# fingerprint, so a server relaunched with other values invalidates extraction.
ARGS_THAT_MATTER = (
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "tp_size",
    "enable_return_hidden_states",
    "enable_return_aux_hidden_states",
    "return_aux_hidden_state_layer_ids",
    "forward_hooks",  # the hook transport's factory and hand-over folder
)


def check_server_args(url: str, info: dict, mode: str, aux_layers: list[int], rule: LayerIdRule) -> dict:
    """The args that matter of one server, after checking its version and mode; `mode` is
    "aux" (aux hidden states of `aux_layers`) or "final" (the plain final-norm state)."""
    version = str(info.get("version"))
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"{url} runs SGLang {version}; supported: {', '.join(SUPPORTED_VERSIONS)} "
            "(the versions whose hidden-state layout is recorded in tests/fixtures/sglang)"
        )
    if not info.get("enable_return_hidden_states"):
        raise ValueError(f"{url} was launched without --enable-return-hidden-states")
    aux_on = bool(info.get("enable_return_aux_hidden_states"))
    sglang_ids = rule.to_sglang(aux_layers)
    flags = f"--return-aux-hidden-state-layer-ids {' '.join(map(str, sglang_ids))}"
    if mode == "aux":
        if not aux_on:
            raise ValueError(f"{url} (extract.sglang_url) needs --enable-return-aux-hidden-states {flags}")
        ids = info.get("return_aux_hidden_state_layer_ids")
        if list(ids or []) != sglang_ids:
            raise ValueError(
                f"{url} captures layers {ids}, but extract.aux_layers resolve to {aux_layers}: {flags}"
            )
    elif aux_on:
        raise ValueError(
            f"{url} (extract.sglang_final_url) returns aux states; it must serve the final-norm "
            "state: launch it without --enable-return-aux-hidden-states"
        )
    for arg, why in rule.forbidden_args.items():
        if info.get(arg):
            raise ValueError(f"{url} runs with {arg} on, which {rule.family} targets cannot use: {why}")
    return {"version": version} | {key: info.get(key) for key in ARGS_THAT_MATTER}


def check_pool_args(infos: dict[str, dict], mode: str, aux_layers: list[int], rule: LayerIdRule) -> dict:
    """One args record for a pool of data-parallel servers, which must all agree."""
    records = {url: check_server_args(url, info, mode, aux_layers, rule) for url, info in infos.items()}
    first_url, first = next(iter(records.items()))
    for url, record in records.items():
        differ = sorted(k for k in first if record[k] != first[k])
        if differ:
            raise ValueError(f"{url} and {first_url} differ in {', '.join(differ)}: serve one configuration")
    return first
