"""The patch-check fingerprint: which target files, on which engine, at which sizes and aux
layers a store's features were computed. patch-check writes it into its report, extract copies it
into the store's manifest, and the later stages compare their inputs by it.

On disk it is a flat JSON object, written with sorted keys: `to_json()` gives exactly the object
the report and the manifest hold (and the extraction config hash digests), `from_json()` reads
one back and names the first key it lacks. The in-process engine (transformers) records its torch
version; an SGLang fingerprint records instead what its servers were launched with (`servers`),
flattened into the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from eagle3.core.inputs import InputError
from eagle3.core.stageio import read_json


@dataclass(frozen=True)
class ServedBy:
    """What SGLang servers computed the features with: the aux servers' args, the final-state
    servers' (None: the target's prediction comes from top-N logprobs or the aux servers), the N
    of top-N logprobs (None: final-norm states) and the layer-id family of the target."""

    server_args: dict[str, Any]
    final_server_args: dict[str, Any] | None
    target_top_logprobs: int | None
    layer_id_family: str


# The fields one engine records and the other does not: absent from the object on disk when None.
ENGINE_OWN = ("torch_version", "servers")


@dataclass(frozen=True)
class Fingerprint:
    engine: str  # the engine that computes the features: "transformers" (hf) or "sglang"
    engine_version: str
    target_source: str  # target.source as given (a packaged name, a folder, a hub id)
    target_sha256: str  # of the weight files
    tokenizer_sha256: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]
    dtype: str  # what the engine computed in
    torch_version: str | None = None  # the in-process engine only
    servers: ServedBy | None = None  # an SGLang engine only

    def to_json(self) -> dict[str, Any]:
        """The object on disk: the fields, aux_layers as a list, `servers` flattened into it, and
        neither engine's own keys when it has none."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ENGINE_OWN}
        out["aux_layers"] = list(self.aux_layers)
        if self.torch_version is not None:
            out["torch_version"] = self.torch_version
        if self.servers is not None:
            out |= {f.name: getattr(self.servers, f.name) for f in fields(ServedBy)}
        return out

    @classmethod
    def from_json(cls, obj: object, where: str) -> Fingerprint:
        """The fingerprint an object on disk holds; InputError naming `where` and the first key
        it lacks."""
        if not isinstance(obj, dict):
            raise InputError(f"{where}: the fingerprint is not a JSON object; run patch-check again")

        def take(names: list[str]) -> dict[str, Any]:
            for name in names:
                if name not in obj:
                    raise InputError(f"{where}: the fingerprint has no {name}; run patch-check again")
            return {name: obj[name] for name in names}

        values = take([f.name for f in fields(cls) if f.name not in ENGINE_OWN])
        values["aux_layers"] = tuple(values["aux_layers"])
        served = None
        if "server_args" in obj:  # an SGLang engine's
            served = ServedBy(**take([f.name for f in fields(ServedBy)]))
        return cls(**values, torch_version=obj.get("torch_version"), servers=served)


def read_fingerprint(report: Path) -> Fingerprint:
    """The fingerprint of a patch-check report file."""
    data = read_json(report)
    return Fingerprint.from_json(data.get("fingerprint") if isinstance(data, dict) else None, str(report))
