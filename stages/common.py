"""What every stage shares: validate the whole params file first, and report a failure with a
non-zero exit: a bad input as one clear line, a bug in the code with its traceback."""

from __future__ import annotations

import errno
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import eagle3
from eagle3.core.inputs import InputError
from eagle3.core.params import Params, ParamsError, load_params

console = Console(stderr=True)
# Input errors: the message says what is wrong and what to do, and a traceback would only bury it.
# ParamsError and InputError (and its subclasses, e.g. CorruptStoreError) mean "fix your input"
# (params, files, data) and exit with 2, like argparse; the others in this group exit with 1.
BAD_INPUT = (ParamsError, InputError)
# A full disk (or quota, or file-size limit): every output is written atomically, so nothing
# half-written stays behind and a re-run after freeing space resumes from what is complete.
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# Where the project's own code lives: a ValueError raised here was raised on purpose, with a
# message for the user (`raise ValueError(f"target.source is ...")`); one raised inside torch,
# numpy or transformers is a call the project got wrong.
PROJECT_CODE = (Path(eagle3.__file__).resolve().parent, Path(__file__).resolve().parent)
# EAGLE3_TRACEBACK=1 prints the traceback of input errors too (where in the code one was raised).
TRACEBACK_ENV = "EAGLE3_TRACEBACK"


def validated_params(path: str = "params.yaml") -> Params:
    try:
        return load_params(path)
    except ParamsError as err:  # one line, every problem on it, like any other stage failure
        console.print(f"[bold red]error:[/] {escape(err.one_line())}", soft_wrap=True)
        sys.exit(2)


def raised_by_project(err: BaseException) -> bool:
    """True when the innermost frame of `err`'s traceback is in eagle3/ or stages/."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = Path(tb.tb_frame.f_code.co_filename).resolve()
    return any(where.is_relative_to(folder) for folder in PROJECT_CODE)


def is_input_error(err: BaseException) -> bool:
    """A failure whose message already says what is wrong and what to do."""
    if isinstance(err, (*BAD_INPUT, FileNotFoundError)):
        return True
    if isinstance(err, OSError) and err.errno in DISK_FULL:
        return True
    # the project's own exception types (SGLangError, LaunchError, PatchCheckError, ...) are only
    # raised on purpose, with a message for the user, whatever builtin they derive from
    if any(cls.__module__.split(".")[0] == "eagle3" for cls in type(err).__mro__):
        return True
    return isinstance(err, ValueError) and raised_by_project(err)


def one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno in DISK_FULL:
        where = err.filename or os.getcwd()
        return (
            f"{os.strerror(err.errno)} writing {where}: free space and re-run "
            "(complete outputs are kept and the run resumes from them)"
        )
    if isinstance(err, ParamsError):  # its problems as one line, not a list
        return "invalid params: " + "; ".join(err.problems)
    return str(err)


@contextmanager
def reported_failures(stage: str) -> Iterator[None]:
    """Input errors (see is_input_error) become one line `<stage> failed: <message>`. Anything else
    (AssertionError, RuntimeError, TypeError, KeyError, ...) is most likely a bug: its traceback
    is printed, then the same one line, so the last line of the log says what failed either way.

    Why the traceback at once rather than one line plus "re-run with EAGLE3_TRACEBACK=1": a bug is
    not something the user can fix from its message, the traceback is what a bug report needs, and
    a stage can fail hours into a run (train, extract): asking for a re-run to see where it failed
    costs those hours again, and the failure may not even recur. The summary line stays last, so a
    user scanning the end of the output still reads one line first.
    """
    try:
        yield
    except Exception as err:
        internal = not is_input_error(err)
        if internal or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            sys.stderr.write("".join(traceback.format_exception(err)))
            sys.stderr.flush()
        message = one_line(err)
        if internal:
            # not one of the failures the code reports on purpose: most likely a bug (report it with
            # the traceback), else the machine (e.g. torch.OutOfMemoryError is a RuntimeError)
            what = f"{type(err).__name__}: {message}" if message else type(err).__name__  # bare assert
            message = f"unexpected {what} (traceback above)"
        # soft_wrap: the message stays one line at any terminal width (and greppable in logs)
        console.print(f"[bold red]{stage} failed:[/] {escape(message)}", soft_wrap=True)
        sys.exit(2 if isinstance(err, BAD_INPUT) else 1)
