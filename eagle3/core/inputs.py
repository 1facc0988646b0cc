"""Inputs the user hands the pipeline: the error for unusable ones, and a strict JSONL reader.

`InputError` is raised for files and folders that are malformed, corrupt, or made by another
run or for another target. Its message names the file (and the line, where there is one) and
says what to do; the stages print it as one line and exit with code 2, as for invalid params
(stages/common.py). Like params.py and stageio.py, this module changes no output.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

# One JSON object per line; a longer line is not JSONL (a JSON array, a binary file) and is
# refused before it is held in memory. 16 MiB is ~50x the longest ShareGPT conversation.
MAX_LINE_BYTES = 16 << 20


class InputError(ValueError):
    """An input file or folder cannot be used as it is; the message names it and the fix."""


def jsonl_lines(path: Path, key: str) -> Iterator[tuple[str, str]]:
    """(text, where) of each non-blank line of a UTF-8 JSONL file, `where` naming the params key,
    the file and the line; InputError when a line is longer than MAX_LINE_BYTES or not UTF-8."""
    with path.open("rb") as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            where = f"{key} {path}, line {number}"
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(
                    f"{where}: longer than {MAX_LINE_BYTES >> 20} MiB (one JSON object per line expected)"
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = f"byte {err.start + 1} is {raw[err.start]:#04x}"
                raise InputError(f"{where}: not UTF-8 ({bad}); save the file as UTF-8") from None
            if text.strip():
                yield text, where
