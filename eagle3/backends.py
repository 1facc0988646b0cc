"""The features backends: what gets a target's hidden states, behind one protocol.

A backend is a set of role functions, each in the module that does that work:
  patch_check(params) -> report            prove capture reads the right layers; fingerprint
  extract(params, fingerprint, out_dir, **options) -> (manifest, dtype)
                                           the extract stage's feature store
  online(params, store) -> OnlineFeed      an online store's features while the drafter trains
  evaluate(params, prompts, drafter_dir, on_prompt) -> EvalOutcome
                                           speculative decoding against plain (eval.backend)
The stages pick a backend by name (`backend_for(params.extract.backend)`) or, for a store that
already exists, by the engine its fingerprint names (`backend_of(fingerprint)`), then call the
role: no stage compares backend names. A new backend is one module of role functions and one
entry in BACKENDS.

The roles are named as strings and imported when called, so a stage's code depends only on its
own role's modules: eagle3/derived/imports.py adds, for each `backend_for(...).<role>` a stage
calls, that role's module of every backend here. A change to the evaluation code must not
re-run an extraction.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagle3.target.fingerprint import Fingerprint

ROLES = ("patch_check", "extract", "online", "evaluate")


@dataclass(frozen=True)
class FeaturesBackend:
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
    def patch_check(self) -> Callable[..., dict]:
        return self.role("patch_check")

    @property
    def extract(self) -> Callable[..., tuple[dict, str]]:
        return self.role("extract")

    @property
    def online(self) -> Callable[..., Any]:
        return self.role("online")

    @property
    def evaluate(self) -> Callable[..., Any]:
        return self.role("evaluate")


BACKENDS: dict[str, FeaturesBackend] = {
    "hf": FeaturesBackend(
        "hf",
        engine="transformers",
        roles={
            "patch_check": "eagle3.target.patch_check:hf_patch_check",
            "extract": "eagle3.data.extract:extract_on_hf",
            "online": "eagle3.train.online:hf_features",
            "evaluate": "eagle3.decoding.hf_eval:evaluate_on_hf",
        },
    ),
    "sglang": FeaturesBackend(
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


def backend_for(name: str) -> FeaturesBackend:
    """The backend a param names (extract.backend, eval.backend)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (allowed: {', '.join(BACKENDS)})")
    return BACKENDS[name]


def backend_of(fingerprint: Fingerprint) -> FeaturesBackend:
    """The backend whose engine made a store: its patch-check fingerprint names the engine."""
    engine = fingerprint.engine
    for backend in BACKENDS.values():
        if backend.engine == engine:
            return backend
    engines = ", ".join(b.engine for b in BACKENDS.values())
    raise ValueError(f"the store was checked on engine {engine!r}, which no backend runs (known: {engines})")


def require_engine(backend: FeaturesBackend, fingerprint: Fingerprint, what: str) -> None:
    """Refuse a patch-check report made on another engine than `backend` runs."""
    if fingerprint.engine != backend.engine:
        raise ValueError(
            f"extract.backend is '{backend.name}' but {what} was checked on {fingerprint.engine}: "
            "run patch-check again"
        )
