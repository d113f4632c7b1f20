"""jaxcert.base.folders: files written whole or not at all, and folders refused when they
were written with other options."""

from __future__ import annotations

import json
import os

import pytest

from jaxcert.base import folders


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    folders.atomic_write(path, "first")
    assert path.read_text() == "first"
    folders.atomic_write(path, b"\x00second", fsync=False)
    assert path.read_bytes() == b"\x00second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    # The ordinary permissions (umask), not mkstemp's 0600.
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "table.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk gone"):
        with folders.atomic_file(path) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".table.bin.")
            tmp.write_bytes(b"half of the new")
            raise RuntimeError("disk gone")
    assert path.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []
    # A failed rename (the target is a folder) also leaves nothing behind.
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x").write_text("x")
    with pytest.raises(OSError):
        folders.atomic_write(tmp_path / "dir", "text")
    assert _leftovers(tmp_path) == [] and (tmp_path / "dir" / "x").read_text() == "x"


def test_two_open_temporaries_have_different_names(tmp_path):
    with folders.atomic_file(tmp_path / "f") as a, folders.atomic_file(tmp_path / "f") as b:
        assert a != b and a.exists() and b.exists()
        a.write_text("a")
        b.write_text("b")
    assert (tmp_path / "f").read_text() == "a"  # the last rename wins: a's block closes last
    assert _leftovers(tmp_path) == []


def test_differing_options_names_nested_keys():
    saved = {"steps": 6, "options": {"top": 10, "eos": True}, "gone": 1}
    now = {"steps": 3, "options": {"top": 10, "eos": False}, "new": 2}
    assert folders.differing_options(saved, now) == [
        "gone", "new", "options", "options.eos", "steps"
    ]  # fmt: skip
    assert folders.differing_options(saved, saved) == []


def test_check_options_records_then_refuses_other_options(tmp_path):
    run = tmp_path / "run"
    folders.check_options(run, {"steps": 6, "taps": (1, 2)}, advice="use --overwrite")
    assert json.loads((run / "options.json").read_text()) == {"steps": 6, "taps": [1, 2]}
    folders.check_options(run, {"steps": 6, "taps": [1, 2]})  # the same: accepted
    with pytest.raises(ValueError) as err:
        folders.check_options(run, {"steps": 3, "taps": [1, 2], "x": "y"}, advice="use --overwrite")
    assert str(err.value) == (
        f"{run} was written with other options: steps (then 6, now 3), x (then unset, now "
        "'y'); use --overwrite"
    )
    fresh = tmp_path / "fresh"
    folders.check_options(fresh, {"steps": 6}, record=False)  # a check alone writes nothing
    assert not fresh.exists()
    with pytest.raises(ValueError, match="steps"):
        folders.check_options(run, {"steps": 3, "taps": [1, 2]}, record=False)
    (run / "options.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"options.json is corrupt \(not a JSON object\)"):
        folders.check_options(run, {"steps": 6})
    # Long values are cut short; a nested difference is named by its leaf.
    with pytest.raises(ValueError) as err:
        folders.refuse_other_options(
            "out", {"sha": "a" * 64, "o": {"k": 1}}, {"sha": "b" * 64, "o": {"k": 2}}, advice="no"
        )
    assert str(err.value) == (
        "out was written with other options: o.k (then 1, now 2), sha (then "
        f"'{'a' * 36}..., now '{'b' * 36}...); no"
    )


def test_keep_on_error_keeps_what_was_written_elsewhere(tmp_path):
    path, kept = tmp_path / "certs.parquet", tmp_path / "certs.partial.parquet"
    path.write_bytes(b"previous")
    with pytest.raises(KeyboardInterrupt):
        with folders.atomic_file(path, keep_on_error=kept) as tmp:
            tmp.write_bytes(b"rows so far")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"previous" and kept.read_bytes() == b"rows so far"
    assert _leftovers(tmp_path) == []
    kept.unlink()
    with pytest.raises(RuntimeError):  # nothing written: nothing kept
        with folders.atomic_file(path, keep_on_error=kept):
            raise RuntimeError
    assert not kept.exists() and _leftovers(tmp_path) == []


def test_read_manifest_names_a_damaged_or_foreign_file_in_one_line(tmp_path):
    from jaxcert.base.folders import read_manifest

    kw = dict(version=1, keys=("spec", "shards"), what="head-record store")
    with pytest.raises(FileNotFoundError, match="no head-record store"):
        read_manifest(tmp_path, **kw)
    path = tmp_path / "manifest.json"
    path.write_text('{"version": 1, "spec": {}, "shards": []}')
    assert read_manifest(tmp_path, **kw)["shards"] == []
    for text, message in [
        ("not json", "is damaged"),
        ('{"version": 1}', "it lacks spec, shards"),
        ("[1, 2]", "it lacks spec, shards"),
        ('{"version": 2, "spec": {}, "shards": []}', "version 2, expected 1"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_manifest(tmp_path, **kw)


def test_check_writable_names_the_file_or_the_folder_above(tmp_path):
    assert folders.check_writable(tmp_path / "a" / "b", "--out") == tmp_path
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ValueError) as err:
        folders.check_writable(tmp_path / "f", "--out")
    assert str(err.value) == f"--out {tmp_path / 'f'} is a file, not a folder"
    with pytest.raises(ValueError) as err:
        folders.check_writable(tmp_path / "f" / "x" / "y", "--export")
    assert str(err.value) == (
        f"--export {tmp_path / 'f' / 'x' / 'y'}: {tmp_path / 'f'} is not a writable folder"
    )
