"""A stage's outputs replaced all together when it succeeds, and not at all when it fails.

DVC deletes a stage's outputs before running it unless they are `persist: true`, and every output
in dvc.yaml is, so a stage that fails (a bad param, a missing file, a dead server, a refusal, a
SIGKILL) leaves the last run's outputs where they were. The stage writes its new outputs into a
staging area instead: `staged.path("metrics/train.json")` is `.stage-commit/train/new/metrics/train.json`
(or, for a top folder on another filesystem than the project, e.g. artifacts/ on a mount, the same
path inside `<top>/.stage-commit-train/`, so that the swap is renames). When its work is done,
`commit` writes a journal naming the outputs, renames each old output aside and the new one into
place, then deletes the journal and the old outputs.

A run that fails or is killed before the journal is written changed no output: its staging area
is removed (on an exception at once; after a kill, by the stage's next run). A run killed during
the renames left the journal: every new output was complete before it was written, so the next run
of the stage finishes the swap (rolls forward) before it stages anything. Resumable work
(artifacts/extract.partial, artifacts/train/checkpoints) lives outside the outputs, untouched.

A folder the stage completed elsewhere (extraction's work folder, which holds the resumable
shards) is `adopt`ed: the commit moves it into place, and a failed run leaves it where it was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.core.pipeline import STAGES
from eagle3.core.stageio import write_json

# Every output of each stage that writes through a commit: its outs, metrics and plots as declared
# (eagle3/core/pipeline.py), all `persist: true` in dvc.yaml.
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {s.name: s.output_paths for s in STAGES if s.staged}
AREA = ".stage-commit"  # at the project root, git-ignored
NEW, OLD = "new", "old"


def journal_path(stage: str, root: Path = Path(".")) -> Path:
    return root / AREA / f"{stage}.json"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _device(path: Path) -> int:
    """The filesystem `path` is (or would be created) on."""
    while not path.exists():
        path = path.parent
    return path.stat().st_dev


class StagedOutputs:
    """Where one run of `stage` writes its outputs, and the commit that puts them in place."""

    def __init__(self, stage: str, root: Path = Path(".")):
        if stage not in STAGE_OUTPUTS:
            raise KeyError(f"{stage} is not a stage with outputs (allowed: {', '.join(STAGE_OUTPUTS)})")
        self.stage, self.root = stage, Path(root)
        self.outputs = [Path(out) for out in STAGE_OUTPUTS[stage]]
        self.adopted: dict[str, Path] = {}
        self.journal = journal_path(stage, self.root)
        tops = sorted({out.parts[0] for out in self.outputs})
        here = _device(self.root.absolute())
        # per top folder, where its staged and set-aside outputs live: renames cannot cross devices
        self.areas = {
            top: (
                self.root / AREA / stage
                if _device((self.root / top).absolute()) == here
                else self.root / top / f"{AREA}-{stage}"
            )
            for top in tops
        }

    def _in_area(self, kind: str, rel: Path) -> Path:
        top = rel.parts[0]
        return self.areas[top] / kind / rel

    def path(self, rel: str | Path) -> Path:
        """Where this run writes output `rel` (project-relative), or a folder holding outputs
        (`plots`): the same relative path inside the staging area."""
        rel = Path(rel)
        if not any(out == rel or out.is_relative_to(rel) or rel.is_relative_to(out) for out in self.outputs):
            raise ValueError(f"{rel} is not an output of stage {self.stage}: {self.outputs}")
        return self._in_area(NEW, rel)

    def adopt(self, rel: str | Path, folder: Path) -> None:
        """The new output `rel` is `folder`, complete: the commit moves it into place."""
        if Path(rel) not in self.outputs:
            raise ValueError(f"{rel} is not an output of stage {self.stage}: {self.outputs}")
        self.adopted[str(rel)] = Path(folder)

    def _clean_up(self, kinds: tuple[str, ...]) -> None:
        for area in set(self.areas.values()):
            for kind in kinds:
                _remove(area / kind)
            for empty in (area, self.root / AREA):
                if empty.is_dir() and not any(empty.iterdir()):
                    empty.rmdir()

    def _sources(self) -> dict[str, Path]:
        """Each output's new version: adopted, or written to its staging path."""
        return {str(out): self.adopted.get(str(out), self._in_area(NEW, out)) for out in self.outputs}

    def recover(self) -> bool:
        """Finish a commit a killed run began (True), and remove what a killed run staged."""
        finished = False
        try:
            record = json.loads(self.journal.read_text())
        except FileNotFoundError:
            record = None
        except ValueError:  # torn: never, it is written atomically; nothing was swapped yet then
            record = None
            self.journal.unlink()
        if record is not None:
            self._swap({out: self.root / src for out, src in record["new"].items()}, record["removed"])
            self.journal.unlink()
            finished = True
        self._clean_up((NEW, OLD))
        return finished

    def commit(self) -> None:
        """Put every new output in place; a declared output this run did not write is removed,
        as DVC removes a stage's outputs before running it."""
        sources = self._sources()
        new = {out: src for out, src in sources.items() if os.path.lexists(src)}
        removed = [out for out in sources if out not in new]
        # the decision, durable before anything moves: a kill from here on is rolled forward
        write_json(
            self.journal,
            {"new": {out: os.path.relpath(src, self.root) for out, src in new.items()}, "removed": removed},
        )
        self._swap(new, removed)
        self.journal.unlink()
        self._clean_up((NEW, OLD))

    def discard(self) -> None:
        """A failed run: its staged outputs go (adopted folders stay: resumable work)."""
        self._clean_up((NEW,))

    def _swap(self, new: dict[str, Path], removed: list[str]) -> None:
        """Renames only, each step skipped when done already, so a re-run after a kill repeats it."""
        for out, src in new.items():
            if not os.path.lexists(src):
                continue  # moved in before the kill
            self._set_aside(out)
            (self.root / out).parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, self.root / out)
        for out in removed:
            self._set_aside(out)

    def _set_aside(self, out: str) -> None:
        current = self.root / out
        if os.path.lexists(current):
            aside = self._in_area(OLD, Path(out))
            aside.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(aside):
                _remove(aside)
            os.replace(current, aside)


@contextmanager
def staged_outputs(stage: str, root: Path = Path(".")) -> Iterator[StagedOutputs]:
    """Write the stage's outputs to `staged.path(...)` inside; they replace the last run's when the
    block ends without an exception, and are dropped when it raises (the old ones stay)."""
    staged = StagedOutputs(stage, root)
    staged.recover()
    try:
        yield staged
    except BaseException:
        staged.discard()
        raise
    staged.commit()
