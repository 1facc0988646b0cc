"""The command-line and reporting side: the `eagle3` command (command.py) and what it shows
(comparison, report, plan, serve commands, the MLflow UI, leftover queue workers). No stage
imports anything here, so touching it re-runs nothing."""

from eagle3.cli.command import main  # the console script's entry point, eagle3.cli:main (pyproject.toml)

__all__ = ["main"]
