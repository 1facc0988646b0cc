"""The `eagle3` subcommands, one per file, each a `SUBCOMMAND` (eagle3/cli/subcommand.py) with its
arguments and its run; eagle3/cli/command.py lists them."""
