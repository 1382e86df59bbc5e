"""Regenerate tests/data/megatron_<release>_flags.json: every command-line option Megatron-LM's
``pretrain_gpt.py`` accepts at one release, with how many values each takes and, where the option
enumerates them, which values it accepts.

The options are read from the checkout's own parser (``megatron.training.arguments.add_megatron_arguments``,
the function ``parse_args`` builds ``pretrain_gpt.py``'s parser with), so flags that Megatron generates
from its config dataclasses (``ArgumentGroupFactory``) are included as well as the ``add_argument`` calls.
Only facts are stored (option names, value counts, value types, accepted values); no Megatron code.

Needs a Megatron-LM checkout and this repository's .venv (torch); no network. Megatron-LM >= 0.19 uses
``typing.override`` (Python 3.12); on older Pythons a no-op stand-in is installed before the import.

    git -C Megatron-LM checkout core_v0.19.0
    .venv/bin/python benchmarks/megatron_flags.py --megatron Megatron-LM --tag core_v0.19.0 \\
        [--commit SHA] [--out tests/data/megatron_core_v0.19.0_flags.json]

The test tests/test_export_megatron_flags.py checks every flag planner/targets/megatron.py writes against the file
named by the release in its SPEC (planner/targets/megatron.py).
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import subprocess
import sys
import typing
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = "NVIDIA/Megatron-LM"
SOURCE = "megatron/training/arguments.py (add_megatron_arguments, incl. ArgumentGroupFactory groups)"


def megatron_parser(checkout: Path) -> argparse.ArgumentParser:
    """The parser ``parse_args`` builds, without the ``pretrain_gpt.py`` extra (ModelOpt) provider."""
    if not hasattr(typing, "override"):  # Python < 3.12: Megatron only uses it as a decorator
        typing.override = lambda f: f  # type: ignore[attr-defined]
    sys.path.insert(0, str(checkout))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    return add_megatron_arguments(parser)


def _nargs(action: argparse.Action) -> int | str:
    """How many values follow the flag: an int, or argparse's '?', '*', '+'."""
    if action.nargs is None:
        return 1
    return action.nargs


def _type_name(action: argparse.Action) -> str:
    t = action.type
    if t in (int, float, str):
        return t.__name__
    return "str" if t is None else "other"  # a converter function: only the value count is checked


def _accepted(action: argparse.Action) -> list[str] | None:
    """The command-line strings that pass the option's ``choices`` after its ``type`` conversion."""
    if action.choices is None:
        return None
    out = []
    for choice in action.choices:
        candidates = [str(choice)]
        if isinstance(choice, enum.Enum):
            candidates += [choice.name, str(choice.value)]
        for text in dict.fromkeys(candidates):
            try:
                value = action.type(text) if action.type else text
            except (KeyError, ValueError, TypeError):
                continue
            if value in action.choices and text not in out:
                out.append(text)
    return out


def flag_table(parser: argparse.ArgumentParser) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        row: dict = {"nargs": _nargs(action), "dest": action.dest}
        if row["nargs"] != 0:
            row["type"] = _type_name(action)
        accepted = _accepted(action)
        if accepted is not None:
            row["choices"] = accepted
        for option in action.option_strings:
            if option.startswith("--"):
                table[option] = row
    return dict(sorted(table.items()))


def _version() -> str:
    """megatron.core.package_info.__shortversion__ of the imported checkout (a tag's commit may already carry
    the next patch number: core_v0.19.0 points at the commit that bumps it to 0.19.1)."""
    from megatron.core import package_info

    return package_info.__shortversion__


def _commit(checkout: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron", type=Path, required=True, help="Megatron-LM checkout at the release")
    ap.add_argument("--tag", required=True, help="release tag the checkout is at, e.g. core_v0.19.0")
    ap.add_argument("--commit", help="commit of the tag (default: the checkout's HEAD)")
    ap.add_argument("--out", type=Path, help="default: tests/data/megatron_<tag>_flags.json")
    args = ap.parse_args()
    table = flag_table(megatron_parser(args.megatron.resolve()))
    data = {
        "repository": REPOSITORY,
        "path": SOURCE,
        "tag": args.tag,
        "commit": args.commit or _commit(args.megatron),
        "package_version": _version(),
        "extracted": datetime.date.today().isoformat(),
        "generator": "benchmarks/megatron_flags.py",
        "fields": "nargs: values after the flag (0 = a switch); type: int/float/str, 'other' = a converter "
        "whose values are not checked; choices: the accepted command-line strings",
        "flags": table,
    }
    out = args.out or ROOT / "tests" / "data" / f"megatron_{args.tag}_flags.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(table)} options from {REPOSITORY}@{args.tag} ({data['commit'][:12]}) -> {out}")


if __name__ == "__main__":
    main()
