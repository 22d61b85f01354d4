"""`membackend comfyui install|uninstall`: idempotent, refuses folders that are not ComfyUI, never
writes or deletes through a link or outside custom_nodes/membackend, keeps the files it did not write,
rolls a failed install back, and the files it writes survive a missing membackend."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from membackend._cli import main
from membackend._comfyui.install import (
    FILES,
    INIT,
    MARKER,
    CannotWrite,
    ForeignFolder,
    Outcome,
    UnsafeLayout,
    install,
    uninstall,
)
from membackend.types import MembackendError


def _comfy(tmp_path):
    root = tmp_path / "ComfyUI"
    (root / "comfy").mkdir(parents=True)
    (root / "custom_nodes").mkdir()
    (root / "main.py").write_text("")
    (root / "comfy" / "model_management.py").write_text("")
    return root


def test_install_writes_the_node_and_is_idempotent(tmp_path, capsys):
    root = _comfy(tmp_path)
    assert main(["comfyui", "install", str(root)]) == 0
    node = root / "custom_nodes" / "membackend"
    assert sorted(p.name for p in node.iterdir()) == ["__init__.py", "prestartup_script.py"]
    first = {p.name: p.read_text() for p in node.iterdir()}
    assert "installed" in capsys.readouterr().out
    assert main(["comfyui", "install", str(root)]) == 0
    assert "already installed" in capsys.readouterr().out
    assert {p.name: p.read_text() for p in node.iterdir()} == first
    for text in first.values():
        compile(text, "node", "exec")
        assert text.startswith(MARKER)


def test_uninstall_removes_it_and_is_idempotent(tmp_path, capsys):
    root = _comfy(tmp_path)
    main(["comfyui", "install", str(root)])
    assert main(["comfyui", "uninstall", str(root)]) == 0
    assert not (root / "custom_nodes" / "membackend").exists()
    assert (root / "custom_nodes").is_dir() and (root / "main.py").exists()
    capsys.readouterr()
    assert main(["comfyui", "uninstall", str(root)]) == 0
    assert "not installed" in capsys.readouterr().out


@pytest.mark.parametrize("missing", ["main.py", "comfy/model_management.py", "custom_nodes"])
@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_a_folder_that_is_not_comfyui_is_refused_with_exit_2(tmp_path, capsys, missing, action):
    root = _comfy(tmp_path)
    target = root / missing
    target.rmdir() if target.is_dir() else target.unlink()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert main(["comfyui", action, str(root)]) == 2
    err = capsys.readouterr().err
    assert "is not a ComfyUI checkout" in err and missing in err and "accepted" in err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_missing_folder_is_refused(tmp_path, capsys):
    assert main(["comfyui", "install", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_a_foreign_custom_node_folder_is_never_touched(tmp_path, capsys):
    root = _comfy(tmp_path)
    foreign = root / "custom_nodes" / "membackend"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("# someone else's node\n")
    assert main(["comfyui", "uninstall", str(root)]) == 2
    assert main(["comfyui", "install", str(root)]) == 2
    assert "not written by membackend" in capsys.readouterr().err
    assert (foreign / "__init__.py").read_text() == "# someone else's node\n"


def test_the_node_files_let_comfyui_start_when_membackend_cannot_be_imported(tmp_path):
    """G6: the prestartup script and __init__ log one line and carry on when membackend is missing."""
    root = _comfy(tmp_path)
    main(["comfyui", "install", str(root)])
    node = root / "custom_nodes" / "membackend"
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "membackend").mkdir()
    (blocker / "membackend" / "__init__.py").write_text("raise ImportError('simulated: membackend not installed')\n")
    for name in ("prestartup_script.py", "__init__.py"):
        out = subprocess.run([sys.executable, "-S", str(node / name)], capture_output=True, text=True,
                             env={"PYTHONPATH": str(blocker)}, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [ln for ln in out.stderr.splitlines() if "membackend" in ln]
        assert len(lines) == 1 and "simulated: membackend not installed" in lines[0], out.stderr


# --------------------------------------------------------------------------- odd layouts: refused, nothing
# outside the node folder changes (and nothing inside, unless the test says so)


def _snapshot(top):
    """path -> (lstat mode, size, sha256 of a regular file's bytes / a link's target), links never followed."""
    seen = {}
    for folder, dirs, files in os.walk(top, followlinks=False):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            else:
                what = None
            seen[os.path.relpath(path, top)] = (st.st_mode, st.st_size if what is not None else None, what)
    return seen


def _outside(snapshot):
    node = os.path.join("ComfyUI", "custom_nodes", "membackend")
    return {p: v for p, v in snapshot.items() if p != node and not p.startswith(node + os.sep)}


def _refused(capsys, root, action, *words):
    """Run the CLI, expect exit 2 and one line on stderr holding ``words``; returns that line."""
    assert main(["comfyui", action, str(root)]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("membackend: "), out.err
    assert "Traceback" not in out.err and out.out == ""
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_a_linked_file_in_the_node_folder_is_never_written_or_deleted_through(tmp_path, capsys, action):
    root = _comfy(tmp_path)
    main(["comfyui", "install", str(root)])
    node = root / "custom_nodes" / "membackend"
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text(INIT if action == "uninstall" else "# a file of the user's\n")  # our text, elsewhere
    (node / "__init__.py").unlink()
    (node / "__init__.py").symlink_to(elsewhere)
    capsys.readouterr()
    before = _snapshot(tmp_path)
    _refused(capsys, root, action, "__init__.py is a symbolic link to", str(elsewhere), "expected a file written by",
             "remove the link")
    assert _snapshot(tmp_path) == before  # inside the node folder too: prestartup_script.py was not removed


@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_a_linked_node_folder_is_refused(tmp_path, capsys, action):
    root = _comfy(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    if action == "uninstall":  # a real install, linked from custom_nodes: still not ours to delete
        for name, text in FILES.items():
            (target / name).write_text(text)
    (root / "custom_nodes" / "membackend").symlink_to(target, target_is_directory=True)
    before = _snapshot(tmp_path)
    _refused(capsys, root, action, "membackend is a symbolic link to", str(target),
             "expected a folder written by `membackend comfyui install`", f"remove the link, then {action} again")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_a_file_where_a_folder_belongs_is_refused(tmp_path, capsys, action):
    root = _comfy(tmp_path)
    (root / "custom_nodes").rmdir()
    (root / "custom_nodes").write_text("not a folder\n")
    before = _snapshot(tmp_path)
    _refused(capsys, root, action, "custom_nodes is a file", "expected ComfyUI's custom_nodes folder")
    assert _snapshot(tmp_path) == before
    (root / "custom_nodes").unlink()
    (root / "custom_nodes").mkdir()
    (root / "custom_nodes" / "membackend").write_text("a file named like the node\n")
    before = _snapshot(tmp_path)
    _refused(capsys, root, action, "membackend is a file", "expected a folder", "move it away")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_a_foreign_init_that_is_not_utf8_is_a_foreign_folder(tmp_path, capsys, action):
    root = _comfy(tmp_path)
    node = root / "custom_nodes" / "membackend"
    node.mkdir()
    (node / "__init__.py").write_bytes(b"\xff\xfe# latin-1: \xe9\n")
    before = _snapshot(tmp_path)
    _refused(capsys, root, action, "not written by membackend", "__init__.py")
    assert _snapshot(tmp_path) == before
    with pytest.raises(ForeignFolder):
        (install if action == "install" else uninstall)(root)


def test_a_folder_that_cannot_be_written_is_rolled_back(tmp_path, capsys, monkeypatch):
    """Tests run as root, where chmod 0o555 stops nothing: the second file's write fails instead."""
    root = _comfy(tmp_path)
    before = _snapshot(tmp_path)
    real_open = os.open

    def refuse_second(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and "__init__.py" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_second)
    line = _refused(capsys, root, "install", "could not write", str(root / "custom_nodes" / "membackend" / "__init__.py"),
                    "PermissionError", "nothing was changed", "expected: a custom_nodes folder this user can write")
    assert ".tmp" not in line
    assert _snapshot(tmp_path) == before  # the node folder and the first file are gone again
    # an earlier version of ours is put back as it was
    monkeypatch.setattr(os, "open", real_open)
    main(["comfyui", "install", str(root)])
    node = root / "custom_nodes" / "membackend"
    for name in FILES:
        (node / name).write_text(MARKER + "\n# an earlier version\n")
    before = _snapshot(tmp_path)
    monkeypatch.setattr(os, "open", refuse_second)
    with pytest.raises(CannotWrite, match="nothing was changed"):
        install(root)
    assert _snapshot(tmp_path) == before


def test_a_failed_rename_puts_the_first_file_back(tmp_path, monkeypatch):
    root = _comfy(tmp_path)
    install(root)
    node = root / "custom_nodes" / "membackend"
    for name in FILES:
        (node / name).write_text(MARKER + "\n# an earlier version\n")
    before = _snapshot(tmp_path)
    real_replace = os.replace
    calls = []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second)
    with pytest.raises(CannotWrite, match="nothing was changed") as err:
        install(root)
    assert isinstance(err.value, OSError)
    assert _snapshot(tmp_path) == before


def test_uninstall_keeps_the_users_files_and_lists_them(tmp_path, capsys):
    root = _comfy(tmp_path)
    main(["comfyui", "install", str(root)])
    node = root / "custom_nodes" / "membackend"
    (node / "notes.txt").write_text("mine\n")
    (node / "x.py").write_text("print('mine')\n")
    cache = node / "__pycache__"
    cache.mkdir()
    for name in ("__init__.cpython-312.pyc", "prestartup_script.cpython-312.opt-1.pyc"):
        (cache / name).write_bytes(b"compiled by ComfyUI")
    (cache / "x.cpython-312.pyc").write_bytes(b"the user's")
    capsys.readouterr()
    before = _outside(_snapshot(tmp_path))
    assert main(["comfyui", "uninstall", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"left 3 file(s) membackend did not write in {node}: __pycache__/, notes.txt, x.py" in out
    assert sorted(p.name for p in node.iterdir()) == ["__pycache__", "notes.txt", "x.py"]
    assert [p.name for p in cache.iterdir()] == ["x.cpython-312.pyc"]
    assert (node / "notes.txt").read_text() == "mine\n" and (node / "x.py").read_text() == "print('mine')\n"
    assert _outside(_snapshot(tmp_path)) == before
    # nothing of ours left: uninstall again changes nothing; install again takes the folder over
    assert uninstall(root) == Outcome(node, False, ("__pycache__/", "notes.txt", "x.py"))
    assert install(root) == Outcome(node, True)
    (cache / "x.cpython-312.pyc").unlink()
    (node / "notes.txt").unlink()
    (node / "x.py").unlink()
    assert uninstall(root) == Outcome(node, True)
    assert not node.exists() and (root / "custom_nodes").is_dir()


def test_uninstall_removes_an_edited_or_earlier_file_of_ours_but_not_a_foreign_one(tmp_path):
    root = _comfy(tmp_path)
    install(root)
    node = root / "custom_nodes" / "membackend"
    (node / "__init__.py").write_text(MARKER + "\n# edited by the user below the marker\n")
    (node / "prestartup_script.py").write_text("# someone else's prestartup\n")
    with pytest.raises(ForeignFolder, match="prestartup_script.py"):
        install(root)  # never overwrites a file it did not write
    assert uninstall(root) == Outcome(node, True, ("prestartup_script.py",))
    assert (node / "prestartup_script.py").read_text() == "# someone else's prestartup\n"


def test_install_and_uninstall_return_an_outcome(tmp_path):
    root = _comfy(tmp_path)
    node = root / "custom_nodes" / "membackend"
    assert install(root) == Outcome(node, True)
    assert install(root) == Outcome(node, False)
    (node / "__init__.py").write_text(MARKER + "\n# an earlier version\n")
    assert install(root) == Outcome(node, True)
    assert (node / "__init__.py").read_text() == INIT
    assert sorted(p.name for p in node.iterdir()) == ["__init__.py", "prestartup_script.py"]  # no temp file left
    assert uninstall(root) == Outcome(node, True)
    assert uninstall(root) == Outcome(node, False)
    for cls in (UnsafeLayout, CannotWrite, ForeignFolder):
        assert issubclass(cls, MembackendError)
