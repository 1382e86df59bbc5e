#!/usr/bin/env python3
"""The house rules a newcomer relies on, measured: prints each figure and PASS/MISS.

    python benchmarks/house.py

- No function in ``planner/ api/ executor/ profiler/`` over 120 lines (the longest are listed).
- ``README.md`` at most 15 KB, a user's manual.
- No link in ``README.md`` or ``docs/`` leaves the repository (relative links resolve inside it; no file
  paths outside it).
- No internal issue numbers ("issue 23") in ``README.md`` or ``docs/`` (an upstream project's "issue #175" is a
  citation, not a session log).
- ``ruff check .`` clean with the project's own rules (``pyproject.toml``), as ``.ci/run`` runs it.
``benchmarks/fingerprint.py`` is the check that a refactor changed no plan, export or validation.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "api", "executor", "profiler")
MAX_FUNCTION_LINES = 120
MAX_README_BYTES = 15 * 1024
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_ISSUE = re.compile(r"\bissue \d+", re.I)


def function_lengths() -> list[tuple[int, str]]:
    """(lines, "path:name") of every function and method in the packages, longest first."""
    out = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(REPO)}:{node.name}"))
    return sorted(out, reverse=True)


def links_leaving_the_repo() -> list[str]:
    """Markdown links of README.md and docs/ that point outside the repository."""
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in _LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue  # a web address or an anchor, not a file
            resolved = (doc.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(REPO):
                bad.append(f"{doc.relative_to(REPO)}: {target}")
    return bad


def issue_numbers() -> list[str]:
    """Lines of README.md and docs/ that name an internal issue number."""
    return [f"{doc.relative_to(REPO)}:{n}" for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
            for n, line in enumerate(doc.read_text().splitlines(), 1) if _ISSUE.search(line)]


def main() -> int:
    failures = 0

    def judge(ok: bool, line: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'MISS'}  {line}")

    lengths = function_lengths()
    over = [(n, name) for n, name in lengths if n > MAX_FUNCTION_LINES]
    judge(not over, f"functions over {MAX_FUNCTION_LINES} lines: {len(over)}; longest: "
          + ", ".join(f"{name} ({n})" for n, name in lengths[:3]))
    size = (REPO / "README.md").stat().st_size
    judge(size <= MAX_README_BYTES, f"README.md {size / 1024:.1f} KB (at most {MAX_README_BYTES // 1024} KB)")
    bad = links_leaving_the_repo()
    judge(not bad, f"links leaving the repository: {len(bad)}" + "".join(f"\n      {b}" for b in bad))
    issues = issue_numbers()
    judge(not issues, f"internal issue numbers in README.md and docs/: {len(issues)}" + "".join(
        f"\n      {i}" for i in issues))
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "."], cwd=REPO, capture_output=True,
                          text=True, check=False)
    judge(ruff.returncode == 0, "ruff check . clean" if ruff.returncode == 0
          else "ruff check . reports:\n" + (ruff.stdout + ruff.stderr)[-2000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
