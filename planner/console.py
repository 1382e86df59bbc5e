"""The command-line programs' rich consoles: markup off, since names, paths and notes come from users'
files ("a[/]b" would crash rich's markup parser and "[red]x[/]" would print as "x"); each program styles
its own words with :func:`styled`. Only the command-line modules import this (rich is theirs)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.text import Text


def make_console(stderr: bool = False, **options: object) -> Console:
    """A console 200 columns wide when not a terminal (a log), markup off; on stderr, messages are not
    wrapped, so an error stays one line."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 200, markup=False,
                   **({"soft_wrap": True} if stderr else {}) | options)


def styled(*parts: str | tuple[str, str]) -> Text:
    """Text from plain strings and (text, style) pairs: user text is never read as markup."""
    return Text.assemble(*parts)
