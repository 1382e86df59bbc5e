"""Errors for bad input: each names the field, the offending value and what would fix it."""

from __future__ import annotations


class AutoparError(ValueError):
    """Bad input to autopar. ``str(err)`` is a complete message a user can act on."""

    def __init__(self, field: str, value: object, fix: str, problem: str | None = None):
        self.field = field
        self.value = value
        self.fix = fix
        self.problem = problem or "is not valid"
        super().__init__(f"{field}={value!r} {self.problem}; {fix}")


class UnknownNameError(AutoparError):
    """A name (preset, cluster, model_type) that is not known; lists what is."""

    def __init__(self, field: str, value: object, known: list[str]):
        super().__init__(field, value, "known: " + ", ".join(sorted(known)), problem="is not known")
        self.known = known
