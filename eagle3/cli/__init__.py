"""The command line: the `eagle3` command. command.py lists the subcommands; each is one file in
commands/, holding its arguments, its run and what it prints (the comparison, the plan, serve
commands, the MLflow UI); queue_workers.py finds leftover queue workers for compare and report.
eagle3/sweep/ computes what they show. No stage imports anything here, so touching it re-runs
nothing."""

from eagle3.cli.command import main  # the console script's entry point, eagle3.cli:main (pyproject.toml)

__all__ = ["main"]
