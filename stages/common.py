"""What every stage shares: validate the whole params file first, and turn known failures into
one clear line and a non-zero exit instead of a traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from eagle3.params import Params, ParamsError, load_params

console = Console(stderr=True)
# Failures whose message already says what is wrong and what to do.
EXPECTED = (ParamsError, ValueError, FileNotFoundError, AssertionError, RuntimeError)


def validated_params(path: str = "params.yaml") -> Params:
    try:
        return load_params(path)
    except ParamsError as err:
        console.print(f"[bold red]error:[/] {err}")
        sys.exit(2)


@contextmanager
def reported_failures(stage: str) -> Iterator[None]:
    try:
        yield
    except EXPECTED as err:
        console.print(f"[bold red]{stage} failed:[/] {err}")
        sys.exit(2 if isinstance(err, ParamsError) else 1)
