"""params.yaml, written from the params schema (eagle3/core/params.py): each key with its default
as the value and its description as the comment, in the schema's order.

Generated rather than hand-kept with a test that compares: a param is then one edit (its field)
and one command, and the file is always in the form `dvc exp run -S` writes back (an empty value
is null, a list one item a line, comments at the end of their key's line), so a `-S` round trip
leaves it byte for byte and an experiment's params diff is its own lines
(tests/test_params_file.py runs DVC's own writer on it). A hand-kept file would drift from that
form as soon as someone wrote `[1, 2]` or `null`, and each description would live twice.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from eagle3.core.params import Params

SCHEMA = "eagle3/core/params.py"
COLUMN = 33  # a key's comment starts after this column, as DVC keeps it
HEADER = """\
# Every knob of the pipeline, written by `eagle3 pipeline write` from eagle3/core/params.py: edit a
# default or a comment there (`eagle3 params explain KEY` prints one). Validated by that schema
# (`eagle3 params check`); each stage re-runs only when the keys it lists in dvc.yaml change. Written
# as `dvc exp run -S` writes it back (an empty value is null, lists one item a line), so an
# experiment's params diff is its own lines.
"""


def _scalar(value: Any) -> str:
    """A value as DVC's writer leaves it: null as nothing, the rest as YAML's plain form."""
    if value is None:
        return ""
    return yaml.safe_dump(value, width=10**6).removesuffix("\n...\n").strip()


def _line(text: str, description: str | None) -> str:
    return f"{text:<{COLUMN}} # {description}" if description else text


def problems(schema: type[Params] = Params) -> list[str]:
    """One line per field the writer cannot write as DVC keeps it."""
    found = []
    for name, section in schema.model_fields.items():
        model: type[BaseModel] = section.annotation
        if not section.description:
            found.append(f"{name}: no description: add Field(description=...) in {SCHEMA}")
        fields = list(model.model_fields.items())
        for key, field in fields:
            if not field.description or "\n" in field.description:
                found.append(f"{name}.{key}: no one-line description: add Field(description=...) in {SCHEMA}")
        last, default = fields[-1][0], getattr(model(), fields[-1][0])
        if isinstance(default, list) and default:
            found.append(
                f"{name}.{last}: a list ends the section, and `dvc exp run -S` drops the blank line after a "
                f"list it replaces: move another key below it in {SCHEMA}"
            )
    return found


def render(schema: type[Params] = Params) -> str:
    """params.yaml's text: the header, then each section and its keys."""
    lines = HEADER.splitlines()
    defaults = schema()
    for i, (name, section) in enumerate(schema.model_fields.items()):
        lines += [""] * (i > 0) + [_line(f"{name}:", section.description)]  # a blank line between sections
        values = getattr(defaults, name)
        for key, field in type(values).model_fields.items():
            value = getattr(values, key)
            if isinstance(value, list):
                lines.append(_line(f"  {key}:", field.description))
                lines += [f"  - {_scalar(item)}" for item in value]
            elif isinstance(value, dict):  # a mapping: one key a line, as DVC writes it back
                lines.append(_line(f"  {key}:", field.description))
                lines += [f"    {_scalar(k)}: {_scalar(v)}" for k, v in value.items()]
            else:
                lines.append(_line(f"  {key}: {_scalar(value)}".rstrip(), field.description))
    text = "\n".join(lines) + "\n"
    if (
        schema.model_validate(yaml.safe_load(text)) != defaults
    ):  # the comments are free text; the values are not
        raise AssertionError(
            "the written params.yaml does not load as the schema's defaults: a bug in the writer"
        )
    return text
