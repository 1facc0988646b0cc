"""What every stage shares: validate the whole params file first, and turn known failures into
one clear line and a non-zero exit instead of a traceback."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape

from eagle3.core.inputs import InputError
from eagle3.core.params import Params, ParamsError, load_params

console = Console(stderr=True)
# Failures whose message already says what is wrong and what to do.
EXPECTED = (ParamsError, ValueError, FileNotFoundError, AssertionError, RuntimeError)
# Of those, the ones that mean "fix your input" (params, files, data) exit with 2, like argparse.
BAD_INPUT = (ParamsError, InputError)
# A full disk (or quota, or file-size limit): every output is written atomically, so nothing
# half-written stays behind and a re-run after freeing space resumes from what is complete.
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def validated_params(path: str = "params.yaml") -> Params:
    try:
        return load_params(path)
    except ParamsError as err:  # one line, every problem on it, like any other stage failure
        console.print(f"[bold red]error:[/] {escape(err.one_line())}", soft_wrap=True)
        sys.exit(2)


@contextmanager
def reported_failures(stage: str) -> Iterator[None]:
    try:
        yield
    except (*EXPECTED, OSError) as err:
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            where = err.filename or os.getcwd()
            message = (
                f"{os.strerror(err.errno)} writing {where}: free space and re-run "
                "(complete outputs are kept and the run resumes from them)"
            )
        elif isinstance(err, EXPECTED):
            message = str(err)
        else:
            raise
        if isinstance(err, ParamsError):  # its problems as one line, not a list
            message = "invalid params: " + "; ".join(err.problems)
        # soft_wrap: the message stays one line at any terminal width (and greppable in logs)
        console.print(f"[bold red]{stage} failed:[/] {escape(message)}", soft_wrap=True)
        sys.exit(2 if isinstance(err, BAD_INPUT) else 1)
