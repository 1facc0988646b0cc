"""The docs as a record: docs/results/ holds one file per dated entry, and its index
(docs/results/README.md) lists every one, newest first, with what supersedes it; every link into a
markdown file's heading (README, CONTRIBUTING, every page under docs/) names a heading that exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
INDEX = RESULTS / "README.md"
# An entry's file and its heading: `YYYY-MM-DD-HHMM-<topic>.md`, `# YYYY-MM-DD HH:MM, <commit>: what`.
ENTRY_FILE = re.compile(r"^(\d{4}-\d{2}-\d{2})-(\d{2})(\d{2})-[a-z0-9][a-z0-9-]*\.md$")
ENTRY_HEADING = re.compile(r"^# (\d{4}-\d{2}-\d{2} \d{2}:\d{2}), (.+?): (.+)$")
# An index row: | date | commit | [what was measured](file) | superseded |
INDEX_ROW = re.compile(r"^\| (\d{4}-\d{2}-\d{2} \d{2}:\d{2}) \| ([^|]+) \| \[(.+)\]\(([^)\s]+)\) \| (.*) \|$")
# How an entry's top says a later one replaces it, and how its index line says the same.
MARKS = {"**Superseded** by ": "superseded by [", "**Partly superseded** by ": "partly, by ["}
# [text](target#anchor) or [text](#anchor); a link's text may hold inline code, not brackets.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]*)#([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markdown marks, lower case, with
    punctuation dropped (word characters, hyphens and spaces stay) and each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The text of every ATX heading (`#` to `######`), fenced code left out."""
    found, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)):
            found.append(m.group(1))
    return found


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`; a repeated one gets -1, -2, ... as GitHub numbers it."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def entry_files(folder: Path) -> list[Path]:
    """The dated entries in `folder`; a markdown file there with another name fails the test."""
    pages = [p for p in folder.glob("*.md") if p.name != "README.md"]
    misnamed = [p.name for p in pages if not ENTRY_FILE.match(p.name)]
    assert not misnamed, f"not named YYYY-MM-DD-HHMM-<topic>.md (lower case, hyphens): {misnamed}"
    return pages


def entry_mark(text: str) -> str | None:
    """How the index must begin the entry's superseded column, from the marks at its top (before
    its first table, list or heading): None where nothing supersedes it."""
    for line in text.splitlines()[1:]:
        if line.startswith(("#", "|", "- ", "```")):
            break
        for mark, column in MARKS.items():
            if line.startswith(mark):
                return column
    return None


def index_problems(folder: Path) -> list[str]:
    """What is wrong between the entries in `folder` and its index, one line each."""
    problems, expected = [], {}
    for page in entry_files(folder):
        text = page.read_text(encoding="utf-8")
        m = ENTRY_HEADING.match(text.splitlines()[0] if text else "")
        y = ENTRY_FILE.match(page.name)
        stamp = f"{y.group(1)} {y.group(2)}:{y.group(3)}"
        if not m or m.group(1) != stamp:
            problems.append(f"{page.name}: its first line is not `# {stamp}, <commit>: <what was measured>`")
            continue
        expected[page.name] = (m, entry_mark(text))
    index = (folder / "README.md").read_text(encoding="utf-8").splitlines()
    rows = [r for r in map(INDEX_ROW.match, index) if r]
    listed = [r.group(4) for r in rows]
    for name, (m, _) in sorted(expected.items(), reverse=True):
        if name not in listed:
            line = f"| {m.group(1)} | {m.group(2)} | [{m.group(3)}]({name}) | |"
            problems.append(f"missing, paste at its place: {line}")
    for row in rows:
        stamp, _, _, name, superseded = row.groups()
        if name not in expected:
            problems.append(f"index lists {name}, which is no entry here")
            continue
        if stamp != expected[name][0].group(1):
            problems.append(f"index dates {name} {stamp}, its heading {expected[name][0].group(1)}")
        mark = expected[name][1]
        if mark is None and superseded.startswith(tuple(MARKS.values())):
            problems.append(f"index says {name} is superseded; its top does not (`**Superseded** by ...`)")
        elif mark is not None and not superseded.startswith(mark):
            problems.append(f"{name} is marked superseded at its top; its index line must say `{mark}...`")
        for later in re.findall(r"\]\(([^)\s]+)\)", superseded):
            if later not in expected:
                problems.append(f"{name}: superseded by {later}, which is no entry here")
            elif later <= name:
                problems.append(f"{name}: superseded by {later}, which is not a later entry")
    stamps = [r.group(1) for r in rows]
    if stamps != sorted(stamps, reverse=True):
        problems.append("the index is not newest first")
    if len(set(listed)) != len(listed):
        problems.append("the index lists an entry twice")
    return problems


def test_slug_matches_github_on_this_repositorys_headings():
    # anchors as GitHub renders them, taken from links that work on github.com
    assert slug("2026-12-02 08:10, 113b1ba: `auto` dtypes under load; what the draft step costs") == (
        "2026-12-02-0810-113b1ba-auto-dtypes-under-load-what-the-draft-step-costs"
    )
    assert slug("2026-12-01 23:11, 30933fd: torch.compile against hand-packed weights") == (
        "2026-12-01-2311-30933fd-torchcompile-against-hand-packed-weights"
    )
    assert slug("EAGLE-3.1 fc_norm and norm_output") == "eagle-31-fc_norm-and-norm_output"
    assert slug("a - b") == "a---b"  # hyphens are not collapsed


def test_results_index_lists_every_entry_newest_first():
    assert len(entry_files(RESULTS)) > 0, f"no dated entry in {RESULTS}"
    problems = index_problems(RESULTS)
    assert not problems, f"{INDEX.relative_to(REPO)} and the entries differ:\n" + "\n".join(problems)


def test_an_unlisted_misdated_or_unmarked_entry_is_found(tmp_path):
    (tmp_path / "2026-01-02-0304-old.md").write_text(
        "# 2026-01-02 03:04, abc1234: an old figure\n\n**Superseded** by [later](2026-01-03-0000-new.md).\n",
        encoding="utf-8",
    )
    (tmp_path / "2026-01-03-0000-new.md").write_text("# 2026-01-03 00:00, def5678: a new figure\n", "utf-8")
    (tmp_path / "2026-01-04-0000-bad.md").write_text("# 2026-01-04 00:01, 0000000: misdated\n", "utf-8")
    (tmp_path / "README.md").write_text(
        "| date | commit | what | superseded |\n| --- | --- | --- | --- |\n"
        "| 2026-01-02 03:04 | abc1234 | [an old figure](2026-01-02-0304-old.md) |  |\n",
        encoding="utf-8",
    )
    new_line = "| 2026-01-03 00:00 | def5678 | [a new figure](2026-01-03-0000-new.md) | |"
    assert index_problems(tmp_path) == [
        "2026-01-04-0000-bad.md: its first line is not `# 2026-01-04 00:00, <commit>: <what was measured>`",
        f"missing, paste at its place: {new_line}",
        "2026-01-02-0304-old.md is marked superseded at its top; "
        "its index line must say `superseded by [...`",
    ]


def broken_heading_links(pages: list[Path]) -> tuple[int, list[str]]:
    """(how many links into a markdown heading `pages` hold, those whose heading is missing)."""
    checked, broken = 0, []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")) or not (target == "" or target.endswith(".md")):
                continue
            checked += 1
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file() or anchor not in anchors(linked):
                broken.append(f"{page.name}: {target}#{anchor}")
    return checked, broken


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Same\n\n## Same\n", encoding="utf-8")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#same-1) [ok](#here) [gone](a.md#same-2) [no file](c.md#top) [web](https://x.org/a.md#z)\n"
        "## Here\n",
        encoding="utf-8",
    )
    assert broken_heading_links([tmp_path / "b.md"]) == (4, ["b.md: a.md#same-2", "b.md: c.md#top"])


def test_links_to_headings_resolve():
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
    checked, broken = broken_heading_links(pages)
    assert checked > 0, "no link into a heading found: the link pattern no longer matches the docs"
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


# Wording that only makes sense to someone outside the repository: a tracker item, the working
# period it was written in, the design notes kept beside the repository.
OUTSIDE = re.compile(r"\b[Ii]ssue #?\d+|\b[Tt]his session\b|\bDESIGN\b|\.\./shared/")


def test_docs_and_code_stand_on_their_own():
    roots = ["README.md", "CONTRIBUTING.md", "dvc.yaml", "params.yaml", "docs", "eagle3", "stages", "bench"]
    roots += ["presets", "tools", "tests"]
    files = []
    for root in map(REPO.joinpath, roots):
        found = [root] if root.is_file() else [*root.rglob("*")]
        files += [f for f in found if f.suffix in {".md", ".py", ".yaml", ".sh"} and f.is_file()]
    files = [f for f in files if f != Path(__file__).resolve()]
    hits = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "say it so that it stands on its own (what, not which tracker item):\n" + "\n".join(hits)
