"""Errors for bad input: each names the field, the offending value and what would fix it."""

from __future__ import annotations

from pydantic import ValidationError


class AutoparError(ValueError):
    """Bad input to autopar. ``str(err)`` is a complete message a user can act on."""

    def __init__(self, field: str, value: object, fix: str, problem: str | None = None):
        self.field = field
        self.value = value
        self.fix = fix
        self.problem = problem or "is not valid"
        super().__init__(f"{field}={value!r} {self.problem}; {fix}")


def validation_problems(exc: ValidationError, what: str | None) -> list[str]:
    """Each problem of a pydantic error as ``what.field=value: explanation`` (``field=value: ...`` with
    no ``what``; no help URL; a whole object's value left out): one wording for every command and
    skip reason."""
    out = []
    for e in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f"={value!r}"
        field = f"{what}.{loc}" if what and loc else (loc or what)
        out.append(f"{field}{shown}: {msg}" if loc else (f"{what}: {msg}" if what else msg))
    return out


class UnknownNameError(AutoparError):
    """A name (preset, cluster, model_type) that is not known; lists what is."""

    def __init__(self, field: str, value: object, known: list[str]):
        super().__init__(field, value, "known: " + ", ".join(sorted(known)), problem="is not known")
        self.known = known
