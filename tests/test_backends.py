"""The backend seam (eagle3/backends.py): the stages pick a backend by name or by the engine
a store's fingerprint names, and call its roles; a new backend is one module of role functions
and one entry in BACKENDS."""

from __future__ import annotations

import sys
import types

import pytest
from conftest import made_up_fingerprint

from eagle3 import backends
from eagle3.backends import FeaturesBackend, backend_for, backend_of, require_engine


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


def test_a_new_backend_is_one_module_and_one_entry(monkeypatch):
    """A module of role functions, registered by one entry, is what the stages get; a role it
    does not have is refused by name."""
    module = types.ModuleType("echo_backend")
    module.extract = lambda params, fingerprint, out_dir, **options: ({"echo": out_dir}, "bfloat16")
    monkeypatch.setitem(sys.modules, "echo_backend", module)
    echo = FeaturesBackend("echo", engine="echo-engine", roles={"extract": "echo_backend:extract"})
    monkeypatch.setitem(backends.BACKENDS, "echo", echo)
    assert backend_for("echo").extract(None, {}, "out") == ({"echo": "out"}, "bfloat16")
    assert backend_of(made_up_fingerprint(engine="echo-engine")) is echo
    with pytest.raises(ValueError, match="the echo backend cannot patch-check"):
        backend_for("echo").patch_check(None)
