"""One `eagle3` subcommand: its name, its help line, the arguments it adds to its own parser and
the function that runs it (torchtune's `tune` keeps one such subcommand per file; so does
eagle3/cli/commands/). A subcommand's module stays light to import: what it runs is imported
when it runs, so `eagle3 preset` does not load torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def fail(err: Exception | str, soft_wrap: bool = True, markup: bool = True) -> int:
    """Print `err` as the one error line on stderr; the exit status of bad input (2)."""
    text = str(err) if markup else escape(str(err))
    Console(stderr=True).print(f"[bold red]error:[/] {text}", highlight=False, soft_wrap=soft_wrap)
    return 2
