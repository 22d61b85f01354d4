"""`membackend comfyui install|uninstall`: idempotent, refuses folders that are not ComfyUI, never
deletes a folder it did not write, and the files it writes survive a missing membackend."""

from __future__ import annotations

import subprocess
import sys

import pytest

from membackend.cli import main
from membackend.comfyui.install import MARKER


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
