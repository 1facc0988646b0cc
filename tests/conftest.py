"""Shared fixtures: the real default target, loaded once per test session (float32 for speed
on CPUs without native bf16; tests that need another dtype load their own)."""

from __future__ import annotations

import pytest

from eagle3.params import TargetParams
from eagle3.target.load import Target, load_target


@pytest.fixture(scope="session")
def smollm2() -> Target:
    return load_target(TargetParams(dtype="float32"))
