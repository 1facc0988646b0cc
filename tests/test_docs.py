"""The docs as a record: docs/results.md's contents list every entry, newest first, each linked by
the anchor GitHub gives its heading, and every link into a markdown file's heading (README,
CONTRIBUTING, every page under docs/) names a heading that exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results.md"
# An entry's heading: `## YYYY-MM-DD HH:MM, <commit>...: what it measured`.
ENTRY = re.compile(r"^## (\d{4}-\d{2}-\d{2} \d{2}:\d{2}), ")
CONTENTS_START = "Entries:"
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


def contents_lines(text: str) -> list[str]:
    """The bullet lines of the contents: from "Entries:" to the first entry's heading."""
    lines = text.splitlines()
    start = lines.index(CONTENTS_START)
    end = next(i for i, line in enumerate(lines) if ENTRY.match(line))
    return [line for line in lines[start + 1 : end] if line.startswith("- ")]


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


def test_results_contents_list_every_entry_newest_first():
    text = RESULTS.read_text(encoding="utf-8")
    entries = [line[3:] for line in text.splitlines() if ENTRY.match(line)]
    assert entries, f"no `## YYYY-MM-DD HH:MM, ...` entry in {RESULTS}"
    stamps = [ENTRY.match(f"## {e}").group(1) for e in entries]
    out_of_order = [(a, b) for a, b in zip(stamps, stamps[1:], strict=False) if a < b]
    assert not out_of_order, f"entries not newest first (older one above newer): {out_of_order}"

    expected = [f"- [{entry}](#{slug(entry)})" for entry in entries]
    listed = contents_lines(text)
    missing = [line for line in expected if line not in listed]
    extra = [line for line in listed if line not in expected]
    assert not missing and not extra, (
        "docs/results.md's contents differ from its entries; missing lines (paste them under "
        f"'{CONTENTS_START}'):\n" + "\n".join(missing) + "\nlisted but no such entry:\n" + "\n".join(extra)
    )
    assert listed == expected, "docs/results.md's contents are not in the entries' order (newest first)"


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
