"""Saving a setting into the user's membackend.toml (``save_setting``, the live headroom's "Apply and save").

Every case runs the save in a child Python that drops to an unprivileged user (``nobody``) when the test
runs as root, after importing what it needs: a root process may write read-only files, and the cases that
matter here are the ones a real user hits. Around each case a snapshot of every path under the test's
folders (type, mode, owner, link target, bytes) proves that nothing but the config file's text changed.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from membackend.types import ConfigChanged, ConfigError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions, links and users")

NOBODY = 65534
ROOT = os.geteuid() == 0
ORIGINAL = '# my settings\nlog_level = "info"  # chatty\n\n[rocm_windows]\naddress_quota = "1TiB"\n'

# The child: imports everything first, then drops to nobody, then runs the saves the spec asks for and prints
# one JSON object: the outcome of each save ({"ok": path} or {"error": type, "message": ...}).
CHILD = r"""
import errno, json, os, resource, sys, threading, time
import tomlkit, tomllib, tempfile, fcntl
import membackend._settings.save as save
from membackend.types import ConfigError
spec = json.loads(sys.argv[1])
if os.geteuid() == 0 and spec["drop"]:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
if spec.get("fsize") is not None:  # a file-size limit (ulimit -f): the kernel stops a write past it
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], resource.RLIM_INFINITY))
if spec.get("disk_room") is not None:  # a disk with room for this many more bytes of the config file
    ino, real_write = os.stat(spec["path"]).st_ino, os.write
    limit = os.stat(spec["path"]).st_size + spec["disk_room"]
    def write(fd, data):
        if os.fstat(fd).st_ino != ino:
            return real_write(fd, data)
        room = limit - os.lseek(fd, 0, os.SEEK_CUR)
        if room <= 0 and len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, bytes(data[:room]))
    os.write = write
leases = []  # the leases the save takes, where it takes any
if getattr(save, "_Lease", None) is not None:
    real_take = save._Lease.take
    def take(self):
        real_take(self)
        leases.append(self)
    save._Lease.take = take
if spec.get("editor_at") is not None:  # the user's editor opens the file for writing (nano: truncate, then write)
    name = spec["editor_at"]           # at the save's first call of os.<name>, and writes it whole
    real_call, editor = getattr(os, name), []
    def rewrite():
        with open(spec["path"], "w", newline="") as f:
            f.write(spec["editor_text"])
    def call(*args, **kwargs):
        if not editor:
            editor.append(threading.Thread(target=rewrite))
            editor[0].start()
            for _ in range(60_000):  # until the editor has written, or waits on the save's lease
                if not editor[0].is_alive() or any(lease.broken() for lease in leases):
                    break
                time.sleep(0.001)
        return real_call(*args, **kwargs)
    setattr(os, name, call)
if spec.get("edit_during") is not None:  # the user's editor writes the file while the save runs
    real_edited = save._edited
    def edited(*args, **kwargs):
        out = real_edited(*args, **kwargs)
        with open(spec["path"], "w", newline="") as f:
            f.write(spec["edit_during"])
        return out
    save._edited = edited
outcomes = []
lock = threading.Lock()
def one(value):
    try:
        got = {"ok": str(save.save_setting(spec.get("key", "headroom"), value, spec["path"]))}
    except ConfigError as exc:
        got = {"error": type(exc).__name__, "message": str(exc)}
    with lock:
        outcomes.append(got)
def worker(values):
    for v in values:
        one(v)
threads = [threading.Thread(target=worker, args=(vs,)) for vs in spec["values"]]
for t in threads: t.start()
for t in threads: t.join()
if spec.get("editor_at") is not None:
    editor[0].join()
print(json.dumps(outcomes))
"""


@pytest.fixture
def home():
    """A folder the unprivileged user owns, outside pytest's root-only tmp tree."""
    folder = Path(tempfile.mkdtemp(prefix="membackend-save-"))
    os.chmod(folder, 0o755)
    if ROOT:
        os.chown(folder, NOBODY, NOBODY)
    yield folder
    for path in folder.rglob("*"):  # give write back so the folder can be removed
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, 0o755)
    os.chmod(folder, 0o755)
    shutil.rmtree(folder)


def owned(path: Path, mode: int | None = None) -> Path:
    """Give ``path`` to the unprivileged user (when root), with ``mode``."""
    if ROOT:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    if mode is not None:
        os.chmod(path, mode)
    return path


def write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    owned(path.parent)
    with open(path, "w", newline="") as f:
        f.write(text)
    return owned(path, mode)


def start(path: Path, values: list[list[str]], *, drop: bool = True, edit_during: str | None = None,
          key: str = "headroom", **more) -> subprocess.Popen:
    """A child saving ``values`` (one thread per list) into ``path``; ``more``: ``fsize`` (a file-size limit),
    ``disk_room`` (bytes the config file may still grow by), ``editor_at`` and ``editor_text`` (an editor
    rewriting the file in place when the save first calls that ``os`` function)."""
    spec = {"path": str(path), "values": values, "drop": drop, "edit_during": edit_during, "key": key, **more}
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def outcomes(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err
    return json.loads(out)


def save(path: Path, value: str = "2GiB", **kwargs) -> dict:
    (got,) = outcomes(start(path, [[value]], **kwargs))
    return got


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every path under ``roots``: (type, mode, uid, gid, link target, bytes)."""
    seen: dict[str, tuple] = {}
    for root in roots:
        for path in [root, *sorted(root.rglob("*"))]:
            st = path.lstat()
            target = os.readlink(path) if path.is_symlink() else None
            data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
            seen[str(path)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, target, data)
    return seen


def changed(before: dict, after: dict) -> set[str]:
    return {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


def settings(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_one_value_changes_and_the_rest_of_the_file_is_kept(home):
    config = write(home / "membackend.toml", 'headroom = "1GiB"  # tuned for my 6 GB card\n' + ORIGINAL)
    before = snapshot(home)
    assert save(config) == {"ok": str(config)}
    assert config.read_text() == 'headroom = "2GiB"  # tuned for my 6 GB card\n' + ORIGINAL
    assert changed(before, snapshot(home)) == {str(config)}


def test_a_new_value_goes_above_the_first_table_and_nothing_else_moves(home):
    config = write(home / "membackend.toml", ORIGINAL)
    assert "ok" in save(config)
    text = config.read_text()
    assert settings(config) == {"headroom": "2GiB", "log_level": "info", "rocm_windows": {"address_quota": "1TiB"}}
    assert text.startswith('# my settings\nlog_level = "info"  # chatty\n')
    assert text.index('headroom = "2GiB"') < text.index("[rocm_windows]")


def test_crlf_line_ends_are_kept(home):
    crlf = ORIGINAL.replace("\n", "\r\n")
    config = write(home / "membackend.toml", 'headroom = "1GiB" # mine\r\n' + crlf)
    assert "ok" in save(config)
    assert config.read_bytes() == ('headroom = "2GiB" # mine\r\n' + crlf).encode()
    config = write(home / "new.toml", crlf)
    assert "ok" in save(config)
    data = config.read_bytes()
    assert b'headroom = "2GiB"\r\n' in data and b"\n" not in data.replace(b"\r\n", b"")


def test_a_multi_line_string_holding_the_key_is_left_alone(home):
    text = 'notes = """\nheadroom = "5GiB"\n"""\n'
    config = write(home / "membackend.toml", text)
    assert "ok" in save(config)
    assert settings(config) == {"notes": 'headroom = "5GiB"\n', "headroom": "2GiB"}
    assert config.read_text().startswith(text)


def test_a_symlinked_config_updates_its_target_and_stays_a_link(home):
    outside = write(home / "dotfiles" / "membackend.toml", ORIGINAL, mode=0o600)
    inside = write(home / "work" / "real.toml", ORIGINAL)
    for target, link in ((outside, home / "work" / "membackend.toml"), (inside, home / "work" / "alias.toml")):
        link.symlink_to(target if target is outside else Path(target.name))
        owned(link)
        before = snapshot(home)
        assert save(link) == {"ok": str(link)}
        assert link.is_symlink() and settings(target)["headroom"] == "2GiB"
        assert changed(before, snapshot(home)) == {str(target)}
        assert stat.S_IMODE(target.stat().st_mode) == (0o600 if target is outside else 0o644)


def test_hard_links_keep_sharing_the_file(home):
    config = write(home / "membackend.toml", ORIGINAL, mode=0o640)
    other = home / "backup" / "membackend.toml"
    other.parent.mkdir()
    owned(other.parent)
    os.link(config, other)
    ino = config.stat().st_ino
    assert "ok" in save(config)
    assert config.stat().st_ino == ino == other.stat().st_ino and other.read_text() == config.read_text()
    assert settings(other)["headroom"] == "2GiB" and stat.S_IMODE(config.stat().st_mode) == 0o640


def test_mode_0600_is_kept(home):
    config = write(home / "membackend.toml", ORIGINAL, mode=0o600)
    assert "ok" in save(config)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and settings(config)["headroom"] == "2GiB"


@pytest.mark.parametrize("mode", [0o444, 0o400])
def test_a_read_only_file_is_refused_and_kept(home, mode):
    config = write(home / "membackend.toml", ORIGINAL, mode=mode)
    before = snapshot(home)
    got = save(config)
    assert got["error"] == "ConfigError" and "read-only" in got["message"] and str(config) in got["message"], got
    assert changed(before, snapshot(home)) == set()


def test_a_read_only_file_is_refused_for_root_too(home):
    config = write(home / "membackend.toml", ORIGINAL, mode=0o444)
    got = save(config, drop=False)
    assert got["error"] == "ConfigError" and "read-only" in got["message"], got
    assert config.read_text() == ORIGINAL


def test_a_folder_without_write_permission_is_refused_and_nothing_changes(home):
    config = write(home / "ro" / "membackend.toml", ORIGINAL)
    os.chmod(config.parent, 0o555)
    before = snapshot(home)
    got = save(config)
    assert got["error"] == "ConfigError" and "no file can be created beside it" in got["message"], got
    assert changed(before, snapshot(home)) == set()


def test_a_link_at_the_old_predictable_temporary_name_is_never_followed(home):
    victim = write(home / "elsewhere" / "victim.txt", "precious\n")
    config = write(home / "conf" / "membackend.toml", ORIGINAL)
    for pid in range(1, 4096):  # every name the old save could have picked in a small pid space
        (config.parent / f".membackend.toml.{pid}.tmp").symlink_to(victim)
    before = snapshot(home)
    assert "ok" in save(config)
    assert victim.read_text() == "precious\n" and changed(before, snapshot(home)) == {str(config)}


@pytest.mark.skipif(not ROOT, reason="only root can hand a file to another owner")
def test_the_owner_is_kept_when_root_saves_and_refused_when_it_cannot_be(home):
    config = write(home / "membackend.toml", ORIGINAL, mode=0o640)
    os.chown(config, 1000, 1000)
    assert "ok" in save(config, drop=False)
    st = config.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o640)
    os.chmod(config, 0o666)  # nobody may write it, but cannot give a new file to uid 1000
    before = snapshot(home)
    got = save(config, "3GiB")
    assert got["error"] == "ConfigError" and "uid 1000" in got["message"], got
    assert changed(before, snapshot(home)) == set()


# one name: the save holds a lease and the edit comes from its own thread, which waits out the kernel's
# lease-break-time (45 s by default) before the save sees the lease broken: the long part
@pytest.mark.parametrize("links", [pytest.param(1, marks=pytest.mark.long), 2], ids=["one name", "hard-linked"])
def test_an_edit_during_the_save_is_kept_and_the_save_says_so(home, links):
    config = write(home / "membackend.toml", ORIGINAL)
    if links == 2:  # written in place, not renamed: the same check before the write
        os.link(config, home / "other-name.toml")
    edit = ORIGINAL + '\n[cuda_wddm]\nheadroom = "1GiB"\n'
    got = save(config, edit_during=edit)
    assert got["error"] == "ConfigChanged" and "your edit is kept" in got["message"], got
    assert config.read_text() == edit
    assert not [p for p in home.iterdir() if p.name.endswith(".tmp")]


def test_saves_racing_in_threads_and_processes_leave_valid_toml(home):
    config = write(home / "membackend.toml", ORIGINAL)
    values = [f"{i}MiB" for i in range(1, 21)]
    procs = [start(config, [values[:10], values[10:]]), start(config, [values[::-1][:10], values[::-1][10:]])]
    results = [o for p in procs for o in outcomes(p)]
    assert len(results) == 40 and all("ok" in o for o in results), [o for o in results if "ok" not in o][:3]
    got = settings(config)
    assert got["headroom"] in values and got["log_level"] == "info" and got["rocm_windows"] == {"address_quota": "1TiB"}
    assert config.read_text().count("headroom") == 1
    assert sorted(p.name for p in home.iterdir()) == ["membackend.toml"]


def test_a_new_file_is_created_with_the_umask_mode(home):
    config = home / "fresh" / "membackend.toml"
    config.parent.mkdir()
    owned(config.parent)
    assert "ok" in save(config)
    assert settings(config) == {"headroom": "2GiB"} and stat.S_IMODE(config.stat().st_mode) == 0o666 & ~os.umask(0o022)
    os.umask(0o022)


def test_bad_input_is_refused_before_the_file_is_touched(home):
    config = write(home / "membackend.toml", 'headroom.inner = 1\n')
    before = snapshot(home)
    got = save(config)
    assert got["error"] == "ConfigError" and "as a table" in got["message"], got
    for key, value, says in (("nonsense", "1", "not a setting"), ("headroom", "x" * 10_000, "headroom")):
        got = save(config, value, key=key)
        assert got["error"] == "ConfigError" and says in got["message"] and len(got["message"]) < 1200, got
    assert changed(before, snapshot(home)) == set()


def test_in_process_errors_are_typed(tmp_path):
    from membackend._settings import save_setting

    config = tmp_path / "membackend.toml"
    config.write_text("not = = toml\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        save_setting("headroom", "1GiB", config)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        save_setting("headroom", "1GiB", fifo)  # and it does not block on the FIFO
    assert issubclass(ConfigChanged, ConfigError)


@pytest.mark.parametrize("limit", ["file-size limit", "full disk"])
def test_a_hard_linked_file_that_cannot_grow_is_refused_and_kept_whole(home, limit):
    config = write(home / "membackend.toml", 'headroom = "1GiB"\n' + ORIGINAL)
    os.link(config, home / "other-name.toml")
    size = config.stat().st_size
    room = {"fsize": size + 2} if limit == "file-size limit" else {"disk_room": 2}
    before = snapshot(home)
    got = save(config, "1024MiB", **room)  # one value growing by 3 bytes, in the file's first line
    assert changed(before, snapshot(home)) == set(), config.read_text()  # on main: cut in the middle of a line
    assert got["error"] == "ConfigError" and "cannot grow by 3 bytes" in got["message"], got
    assert "nothing was changed" in got["message"] and "ulimit -f" in got["message"], got
    assert "ok" in save(config, "2GiB", **room)  # as long: written over its own bytes, no room needed
    assert config.read_text() == 'headroom = "2GiB"\n' + ORIGINAL and (home / "other-name.toml").read_text() == \
        config.read_text()


@pytest.mark.parametrize("links", [1, 2], ids=["one name", "hard-linked"])
def test_a_file_an_editor_is_rewriting_in_place_is_not_touched(home, links):
    config = write(home / "membackend.toml", ORIGINAL)
    if links == 2:
        os.link(config, home / "other-name.toml")
    edit = ORIGINAL + '\n[cuda_wddm]\nheadroom = "1GiB"\n'
    with open(config, "w", newline="") as editor:  # nano's save: truncated, not yet written
        got = save(config)
        editor.write(edit)
    assert config.read_text() == edit, got  # on main: the whole file was 'headroom = "2GiB"'
    assert got["error"] == "ConfigChanged" and "is open" in got["message"], got
    assert sorted(p.name for p in home.iterdir()) == ["membackend.toml", "other-name.toml"][:links]


@pytest.mark.parametrize("links,at", [(1, "replace"), (2, "ftruncate")], ids=["one name", "hard-linked"])
def test_an_editor_opening_the_file_while_it_is_saved_keeps_its_text(home, links, at):
    config = write(home / "membackend.toml", ORIGINAL)
    if links == 2:
        os.link(config, home / "other-name.toml")
    edit = ORIGINAL + '\n[cuda_wddm]\nheadroom = "1GiB"\n'
    got = save(config, editor_at=at, editor_text=edit)  # the editor opens it just before the rename / the write
    assert config.read_text() == edit, got  # on main: the editor wrote a file the rename had taken the name from
    assert got["error"] == "ConfigChanged", got
    assert sorted(p.name for p in home.iterdir()) == ["membackend.toml", "other-name.toml"][:links]
