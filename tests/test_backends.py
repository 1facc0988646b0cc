"""The backend seam (eagle3/backends.py): the stages pick a backend by name or by the engine
a store's fingerprint names, and call its roles; a new backend is one module of role functions
and one entry in BACKENDS."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable

import pytest
from conftest import made_up_fingerprint

from eagle3 import backends
from eagle3.backends import TargetBackend, backend_for, backend_of, require_engine


def test_a_name_picks_its_backend_and_a_wrong_one_names_the_allowed():
    assert backend_for("hf").engine == "transformers"
    assert backend_for("sglang").engine == "sglang"
    with pytest.raises(ValueError, match=r"unknown backend 'vllm' \(allowed: hf, sglang\)"):
        backend_for("vllm")


def test_a_store_is_read_by_the_backend_whose_engine_made_it():
    assert backend_of(made_up_fingerprint(engine="transformers")).name == "hf"
    assert backend_of(made_up_fingerprint(engine="sglang")).name == "sglang"
    with pytest.raises(ValueError, match="engine 'vllm', which no backend runs"):
        backend_of(made_up_fingerprint(engine="vllm"))


def test_a_report_of_another_engine_is_refused():
    require_engine(backend_for("hf"), made_up_fingerprint(engine="transformers"), "report.json")
    refused = "extract.backend is 'sglang' but report.json was checked on transformers"
    with pytest.raises(ValueError, match=refused):
        require_engine(backend_for("sglang"), made_up_fingerprint(engine="transformers"), "report.json")


def test_every_role_resolves_to_a_function():
    for backend in backends.BACKENDS.values():
        for role in backend.roles:
            assert callable(backend.role(role)), (backend.name, role)


def takes(function: Callable, protocol: type) -> str | None:
    """Why `function` cannot be called as `protocol` says (None: it can): the Protocol's
    parameters, by name and in order, then only parameters with defaults (or **options)."""
    wanted = list(inspect.signature(protocol.__call__).parameters.values())[1:]  # without self
    have = list(inspect.signature(function).parameters.values())
    named = [p for p in wanted if p.kind is not p.VAR_KEYWORD]
    if [p.name for p in have[: len(named)]] != [p.name for p in named]:
        return f"parameters {[p.name for p in have]}, not starting {[p.name for p in named]}"
    extra = [p for p in have[len(named) :] if p.default is p.empty and p.kind is not p.VAR_KEYWORD]
    if extra:
        return f"{extra[0].name} has no default"
    if len(named) < len(wanted) and not any(p.kind is p.VAR_KEYWORD for p in have):
        return "no **options"
    return None


def test_every_role_function_takes_its_roles_protocol():
    for backend in backends.BACKENDS.values():
        for role in backend.roles:
            why = takes(backend.role(role), backends.ROLE_PROTOCOLS[role])
            assert why is None, f"{backend.name}.{role}: {why}"
    # the check can fail: an online role is not an extraction
    assert takes(backend_for("hf").online, backends.ExtractRole) is not None


def test_a_new_backend_is_one_module_and_one_entry(monkeypatch):
    """A module of role functions, registered by one entry, is what the stages get; a role it
    does not have is refused by name."""
    module = types.ModuleType("echo_backend")
    module.extract = lambda params, fingerprint, out_dir, **options: ({"echo": out_dir}, "bfloat16")
    monkeypatch.setitem(sys.modules, "echo_backend", module)
    echo = TargetBackend("echo", engine="echo-engine", roles={"extract": "echo_backend:extract"})
    monkeypatch.setitem(backends.BACKENDS, "echo", echo)
    assert backend_for("echo").extract(None, {}, "out") == ({"echo": "out"}, "bfloat16")
    assert backend_of(made_up_fingerprint(engine="echo-engine")) is echo
    with pytest.raises(ValueError, match="the echo backend cannot patch-check"):
        backend_for("echo").patch_check(None)
