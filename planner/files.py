"""Where the commands write their results: checked before the work, and never lost after it.

A profile takes a minute to an hour to measure, a training run longer, a search up to its time
budget: an output path that cannot be written must stop the command before that work, with the
flag, the path and the fix (:func:`check_out`, :func:`check_out_dir`), and a write that fails anyway
at the end (the disk filled, the folder went) keeps the result somewhere and says where
(:func:`write_or_keep`), instead of a traceback and a lost result.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from planner.errors import AutoparError

MAX_INPUT_BYTES = 256 << 20  # a plan, spec or profile is kilobytes to a few MB; more is not one


def read_input(path: Path, flag: str, what: str = "JSON file") -> str:
    """The text of an input file or pipe, or an AutoparError naming ``flag``: missing, a folder, over
    :data:`MAX_INPUT_BYTES` (``/dev/zero`` is read no further), unreadable, or not UTF-8 (a binary file)."""
    fix = f"give the path of a readable {what}"
    if not path.exists():
        raise AutoparError(flag, str(path), fix, problem="does not exist")
    if path.is_dir():
        raise AutoparError(flag, str(path), fix, problem="is a folder")
    too_big = AutoparError(flag, str(path), fix, problem=f"holds more than {MAX_INPUT_BYTES:,} bytes, more than any "
                           f"{what} ({MAX_INPUT_BYTES >> 20} MiB at most)")
    try:
        if path.is_file() and path.stat().st_size > MAX_INPUT_BYTES:
            raise too_big
        with path.open("rb") as f:  # a pipe (<(...), /dev/stdin) is read too, but never past the limit
            data = f.read(MAX_INPUT_BYTES + 1)
        if len(data) > MAX_INPUT_BYTES:  # /dev/zero
            raise too_big
        return data.decode("utf-8")
    except OSError as exc:
        raise AutoparError(flag, str(path), fix, problem=f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise AutoparError(flag, str(path), fix,
                           problem=f"is not UTF-8 text (byte {exc.start}: a binary file?)") from None


def unused_path(path: Path) -> Path:
    """``path``, or ``name-2.json``, ``name-3.json``... if it is taken: a kept body never overwrites a file."""
    n = 2
    candidate = path
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        n += 1
    return candidate


def _writable_folder(folder: Path) -> None:
    """Raise OSError unless a file can be created in ``folder`` or, where it does not exist yet, in
    the nearest folder above it that does (creating nothing that stays)."""
    ancestor = folder
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(20, f"{ancestor} is a file")
    with tempfile.NamedTemporaryFile(dir=ancestor, prefix=".autopar-write-check-"):
        pass


def check_out(out: Path, example: str, flag: str = "--out") -> None:
    """Refuse a file path a result could not be written to: a folder (the fix suggests ``example``
    in it), a path under a file, in a folder this process cannot create files in (read-only, /proc),
    or a read-only file."""
    if out.is_dir():
        raise AutoparError(flag, str(out), f"give a file path, e.g. {out / example}", problem="is a folder")
    try:
        _writable_folder(out.parent)
        if out.exists() and not os.access(out, os.W_OK):
            raise PermissionError(13, "the file is read-only")
    except OSError as exc:
        raise AutoparError(flag, str(out), "give a path in a folder this user can write to",
                           problem=f"cannot be written ({exc.strerror or exc})") from None


def check_out_dir(out_dir: Path, flag: str) -> None:
    """Refuse a folder results could not be written into: a file, under a file, or not writable."""
    if out_dir.exists() and not out_dir.is_dir():
        raise AutoparError(flag, str(out_dir), "give a folder (it is made if missing)", problem="is a file")
    try:
        _writable_folder(out_dir)
    except OSError as exc:
        raise AutoparError(flag, str(out_dir), "give a folder this user can write to",
                           problem=f"cannot be written ({exc.strerror or exc})") from None


def _replace_all(pairs: list[tuple[Path, str]]) -> None:
    """Write each (path, text) to a temporary file beside its path, then move them all into place
    (``os.replace``, atomic per file on one file system): a failure while writing (a full disk, a
    dangling link, a read-only file) leaves every path as it was, and removes the temporary files."""
    staged: list[tuple[str, Path]] = []
    try:
        umask = os.umask(0)
        os.umask(umask)
        for path, text in pairs:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
            staged.append((tmp, path))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            # the mode a plain write gives (mkstemp's is 0600): the old file's, else 0666 less the umask
            os.chmod(tmp, path.stat().st_mode & 0o7777 if path.is_file() else 0o666 & ~umask)
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)


def write_files(out_dir: Path, files: dict[str, str], flag: str) -> list[Path]:
    """Write ``files`` (name -> text) into ``out_dir`` (made if missing), all or none: a folder in the
    way of one is refused before anything is written, and the files are written beside their targets
    and only then moved into place (:func:`_replace_all`), so a write that fails leaves none of them
    changed. Either is an AutoparError naming ``flag``."""
    targets = [out_dir / name for name in files]
    for path in targets:
        if path.is_dir():
            raise AutoparError(flag, str(out_dir), f"move {path} away, or give another folder",
                               problem=f"holds a folder where {path.name} is to be written")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        _replace_all(list(zip(targets, files.values())))
    except OSError as exc:
        raise AutoparError(flag, str(out_dir), "give a folder this user can write to, with room; none of its files "
                           "was changed", problem=f"could not be written ({exc.strerror or exc}: "
                           f"{exc.filename or ''})") from None
    return targets


def kept_name(stem: str) -> str:
    """The file name a result kept away from where it was asked to go gets: ``<stem>-<time>.json``."""
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def keep_somewhere(text: str, stem: str) -> Path | None:
    """Write a result that could not go where it was asked to ``<stem>-<time>.json`` in the working
    folder (where it still exists), else in the temporary folder; the path, or None where neither
    could be written."""
    name = kept_name(stem)
    for folder in (Path.cwd, lambda: Path(tempfile.gettempdir())):
        try:
            path = unused_path(folder() / name)
            path.write_text(text)
            return path
        except OSError:  # the working folder itself may be gone (FileNotFoundError from cwd)
            continue
    return None


def write_or_keep(out: Path, text: str, flag: str, what: str, stem: str, also: str = "") -> None:
    """Write ``text`` to ``out`` (its folders made); where that fails, keep it (:func:`keep_somewhere`)
    and raise an AutoparError naming ``flag``, the path and where the ``what`` is now (``also``: what
    else became of it, e.g. that the service stored it)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _replace_all([(out, text)])  # a full disk leaves the old file whole, not a truncated new one
        return
    except OSError as exc:
        failed = exc
    kept = keep_somewhere(text, stem)
    where = f"the {what} is kept in {kept}" if kept else f"the {what} could not be kept anywhere on this host"
    raise AutoparError(flag, str(out), f"{where}{also}; move it where you want it",
                       problem=f"could not be written ({failed.strerror or failed})")
