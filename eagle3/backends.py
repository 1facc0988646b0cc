"""The target backends: what runs the target model, in this process (hf) or on SGLang servers
(sglang), for each piece of work a stage asks of it, behind one protocol per role.

A backend is a set of role functions, each in the module that does that work; each role's
signature is a Protocol below, so a type checker sees what a stage passes and gets back:
  patch_check: PatchCheckRole   (params) -> report: prove capture reads the right layers; the
                                fingerprint (the report's "fingerprint")
  extract: ExtractRole          (params, fingerprint, out_dir, **options) -> (manifest, dtype):
                                the extract stage's feature store
  online: OnlineRole            (params, store) -> OnlineFeed: an online store's features while the
                                drafter trains
  evaluate: EvaluateRole        (params, prompts, drafter_dir, on_prompt) -> EvalOutcome:
                                speculative decoding against plain (eval.backend)
The stages pick a backend by name (`backend_for(params.extract.backend)`) or, for a store that
already exists, by the engine its fingerprint names (`backend_of(fingerprint)`), then call the
role: no stage compares backend names. A new backend is one module of role functions and one
entry in BACKENDS.

The roles are named as strings and imported when called, so a stage's code depends only on its
own role's modules: eagle3/derived/imports.py adds, for each `backend_for(...).<role>` a stage
calls, that role's module of every backend here. A change to the evaluation code must not
re-run an extraction. The Protocols' types are imported for type checkers only (TYPE_CHECKING),
which eagle3/derived/imports.py does not count as a dep.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from eagle3.core.params import Params
    from eagle3.data.store import FeatureStore
    from eagle3.decoding.evaluate import EvalOutcome
    from eagle3.decoding.prompts import Prompt
    from eagle3.target.fingerprint import Fingerprint
    from eagle3.train.online import OnlineFeed


class PatchCheckRole(Protocol):
    def __call__(self, params: Params) -> dict[str, Any]: ...


class ExtractRole(Protocol):
    def __call__(
        self, params: Params, fingerprint: Fingerprint, out_dir: Path, **options: int | dict | None
    ) -> tuple[dict, str]: ...


class OnlineRole(Protocol):
    def __call__(self, params: Params, store: FeatureStore) -> OnlineFeed: ...


class EvaluateRole(Protocol):
    def __call__(
        self,
        params: Params,
        prompts: list[Prompt],
        drafter_dir: Path,
        on_prompt: Callable[[str], None] | None = None,
    ) -> EvalOutcome: ...


# each role's Protocol, by the role's name in BACKENDS
ROLE_PROTOCOLS: dict[str, type] = {
    "patch_check": PatchCheckRole,
    "extract": ExtractRole,
    "online": OnlineRole,
    "evaluate": EvaluateRole,
}
ROLES = tuple(ROLE_PROTOCOLS)


@dataclass(frozen=True)
class TargetBackend:
    """One backend: its params name, the engine its patch-check fingerprints, and for each role
    the `module:function` that does it (a role it cannot do is absent)."""

    name: str
    engine: str
    roles: dict[str, str]

    def role(self, role: str) -> Callable[..., Any]:
        if role not in self.roles:
            raise ValueError(f"the {self.name} backend cannot {role.replace('_', '-')}")
        module, function = self.roles[role].split(":")
        return getattr(importlib.import_module(module), function)

    @property
    def patch_check(self) -> PatchCheckRole:
        return cast("PatchCheckRole", self.role("patch_check"))

    @property
    def extract(self) -> ExtractRole:
        return cast("ExtractRole", self.role("extract"))

    @property
    def online(self) -> OnlineRole:
        return cast("OnlineRole", self.role("online"))

    @property
    def evaluate(self) -> EvaluateRole:
        return cast("EvaluateRole", self.role("evaluate"))


BACKENDS: dict[str, TargetBackend] = {
    "hf": TargetBackend(
        "hf",
        engine="transformers",
        roles={
            "patch_check": "eagle3.target.patch_check:hf_patch_check",
            "extract": "eagle3.data.extract:extract_on_hf",
            "online": "eagle3.train.online:hf_features",
            "evaluate": "eagle3.decoding.hf_eval:evaluate_on_hf",
        },
    ),
    "sglang": TargetBackend(
        "sglang",
        engine="sglang",
        roles={
            "patch_check": "eagle3.sglang.patch_check:sglang_patch_check",
            "extract": "eagle3.sglang.extract:extract_with_sglang",
            "online": "eagle3.sglang.online:sglang_features",
            "evaluate": "eagle3.sglang.evaluate:evaluate_on_sglang",
        },
    ),
}


def backend_for(name: str) -> TargetBackend:
    """The backend a param names (extract.backend, eval.backend)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (allowed: {', '.join(BACKENDS)})")
    return BACKENDS[name]


def backend_of(fingerprint: Fingerprint) -> TargetBackend:
    """The backend whose engine made a store: its patch-check fingerprint names the engine."""
    engine = fingerprint.engine
    for backend in BACKENDS.values():
        if backend.engine == engine:
            return backend
    engines = ", ".join(b.engine for b in BACKENDS.values())
    raise ValueError(f"the store was checked on engine {engine!r}, which no backend runs (known: {engines})")


def require_engine(backend: TargetBackend, fingerprint: Fingerprint, what: str) -> None:
    """Refuse a patch-check report made on another engine than `backend` runs."""
    if fingerprint.engine != backend.engine:
        raise ValueError(
            f"extract.backend is '{backend.name}' but {what} was checked on {fingerprint.engine}: "
            "run patch-check again"
        )
