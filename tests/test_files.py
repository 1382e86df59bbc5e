"""planner.files: output paths checked before the work, results kept when a write fails after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import AutoparError
from planner.files import check_out, check_out_dir, keep_somewhere, unused_path, write_or_keep


def test_a_kept_file_never_overwrites_one(tmp_path):
    (tmp_path / "r.json").write_text("1")
    (tmp_path / "r-2.json").write_text("2")
    assert unused_path(tmp_path / "r.json") == tmp_path / "r-3.json"
    assert unused_path(tmp_path / "new.json") == tmp_path / "new.json"


def test_check_out_refuses_what_cannot_be_written_and_makes_nothing(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(AutoparError, match=r"is a folder; give a file path, e\.g\. .*plan\.json"):
        check_out(tmp_path, "plan.json")
    with pytest.raises(AutoparError, match=r"--report='.*' cannot be written \(.*afile is a file\)"):
        check_out(afile / "a" / "b.json", "r.json", flag="--report")
    check_out(afile, "r.json")  # an existing writable file: overwritten at the end
    check_out(tmp_path / "to" / "make" / "r.json", "r.json")
    with pytest.raises(AutoparError, match=r"--out-dir='.*afile' is a file; give a folder"):
        check_out_dir(afile, "--out-dir")
    with pytest.raises(AutoparError, match=r"cannot be written"):
        check_out_dir(afile / "sub", "--out-dir")
    check_out_dir(tmp_path / "to" / "make", "--out-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_failed_write_keeps_the_result_and_names_it(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(AutoparError) as err:
        write_or_keep(tmp_path / "afile" / "r.json", '{"a": 1}', "--out", "run report", "autopar-run",
                      also="; the service stored it as run #7")
    (kept,) = here.iterdir()
    assert kept.name.startswith("autopar-run-") and kept.read_text() == '{"a": 1}'
    message = str(err.value)
    assert message.startswith(f"--out='{tmp_path / 'afile' / 'r.json'}' could not be written (")
    assert f"the run report is kept in {kept}; the service stored it as run #7; move it" in message
    write_or_keep(tmp_path / "made" / "r.json", "ok", "--out", "run report", "autopar-run")
    assert (tmp_path / "made" / "r.json").read_text() == "ok"


def test_keep_somewhere_falls_back_to_the_temporary_folder(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Path, "cwd", classmethod(lambda cls: Path("/proc")))  # no file can be made there
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    kept = keep_somewhere("body", "autopar-plan")
    assert kept is not None and kept.parent == tmp_path and kept.read_text() == "body"


def test_read_input_refuses_what_is_not_a_readable_text_file(tmp_path, monkeypatch):
    import planner.files
    from planner.files import read_input

    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert read_input(tmp_path / "ok.json", "--x") == '{"a": 1}'
    (tmp_path / "bin.json").write_bytes(b"\x80\x81\xff\xfe")
    cases = [(tmp_path / "bin.json", r"--x='.*bin\.json' is not UTF-8 text \(byte 0: a binary file\?\)"),
             (tmp_path / "missing.json", r"does not exist"), (tmp_path, r"is a folder")]
    if Path("/dev/zero").exists():  # read whole, it would fill memory: read no further than the limit
        cases.append((Path("/dev/zero"), r"--x='/dev/zero' holds more than 268,435,456 bytes"))
    for path, said in cases:
        with pytest.raises(AutoparError, match=said):
            read_input(path, "--x")
    monkeypatch.setattr(planner.files, "MAX_INPUT_BYTES", 4)
    with pytest.raises(AutoparError, match=r"holds more than 4 bytes, more than any JSON file"):
        read_input(tmp_path / "ok.json", "--x")
    # a pipe is read (process substitution, /dev/stdin), never past the limit
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("[1]"))
    writer.start()
    assert read_input(fifo, "--x") == "[1]"
    writer.join()


def test_write_files_changes_none_when_one_write_fails(tmp_path, monkeypatch):
    import tempfile as tf

    from planner.files import write_files

    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "b.txt").write_text("old b")
    real, calls = tf.mkstemp, []

    def second_fails(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a full disk at the second file
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(tmp_path / "b.txt"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tf, "mkstemp", second_fails)
    with pytest.raises(AutoparError, match=r"could not be written \(No space left on device.*none of its files was "
                                           r"changed"):
        write_files(tmp_path, {"a.txt": "new a", "b.txt": "new b"}, "--out-dir")
    assert (tmp_path / "a.txt").read_text() == "old a" and (tmp_path / "b.txt").read_text() == "old b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]  # no partial file left
    monkeypatch.setattr(tf, "mkstemp", real)
    write_files(tmp_path, {"a.txt": "new a", "b.txt": "new b"}, "--out-dir")
    assert (tmp_path / "a.txt").read_text() == "new a" and oct((tmp_path / "b.txt").stat().st_mode & 0o777) != "0o600"
