"""What the docs count is what ships (the platform plugins, the settings they declare, the kit's rounds), sizes
are written one way (``membackend.types.format_size``: the doctor and the memory panel here; the per-load lines in
tests/test_comfyui_status.py), the
headroom's source one way (``<platform|backend> NAME's own rule``), and the README's first screen says who
the project is for, with its two commands before any table."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import membackend
from membackend import _cli as cli
from membackend.testing import conformance
from membackend.types import format_size

ROOT = Path(membackend.__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]
PLUGINS = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())
WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}


def _platforms():
    import importlib

    return {name: importlib.import_module(f"membackend_{name}").PLATFORM for name in PLUGINS}


# --------------------------------------------------------------------------- counts


def test_every_count_of_the_platform_plugins_in_the_docs_is_the_number_that_ship():
    assert len(PLUGINS) == 4, PLUGINS
    said = [(doc.relative_to(ROOT), m.group(0)) for doc in DOCS
            for m in re.finditer(r"\b(two|three|four|five|six|seven|eight|\d+) (?:platform )?plugins\b",
                                 doc.read_text(), re.I)]
    assert said, "no count of the plugins found: the pattern is out of date"
    wrong = [f"{doc}: {text!r}" for doc, text in said
             if WORDS.get(text.split()[0].lower(), None if not text.split()[0].isdigit() else int(text.split()[0]))
             != len(PLUGINS)]
    assert wrong == []


def test_backends_md_describes_each_plugin_that_ships():
    text = (ROOT / "docs" / "backends.md").read_text()
    section = text.split("## The platform plugins in this repository", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^\*\*`(\w+)`\*\*", section, re.M)) == PLUGINS


def test_settings_md_lists_every_setting_each_plugin_declares():
    text = (ROOT / "docs" / "settings.md").read_text()
    table = text.split("platform plugins of this repository declare:", 1)[1].split("\n\n", 2)[1]
    listed = sorted(re.findall(r"^\| `(\w+\.\w+)` /", table, re.M))
    declared = sorted(f"{name}.{s.name}" for name, platform in _platforms().items() for s in platform.settings)
    assert listed == declared


def test_the_kit_docs_give_its_threads_and_rounds_as_the_code_runs_them():
    text = " ".join((ROOT / "docs" / "kit.md").read_text().split())
    words = {v: k for k, v in WORDS.items()}
    assert (f"{words[conformance.AT_ONCE]} faults on different reservations at once, {conformance.AT_ONCE_ROUNDS} "
            "rounds") in text


# --------------------------------------------------------------------------- sizes, one way

#: a size as format_size writes it
SIZE = r"-?\d[\d,]*\.\d (?:KiB|MiB|GiB|TiB|PiB)|-?\d+ bytes?"


@pytest.mark.parametrize("n, text", [(0, "0 bytes"), (1, "1 byte"), (1023, "1023 bytes"), (1024, "1.0 KiB"),
                                     (512 << 20, "512.0 MiB"), (6 << 30, "6.0 GiB"), (5632 << 20, "5.5 GiB"),
                                     (-(3 << 30), "-3.0 GiB"), (1536 << 40, "1.5 PiB")])
def test_a_size_is_written_in_binary_units_with_one_decimal(n, text):
    assert format_size(n) == text
    assert re.fullmatch(SIZE, text)


def test_the_doctor_writes_every_size_one_way(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "wddm-6gb")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    budget = next(line for line in out.splitlines() if line.strip().startswith("cuda:0: total"))
    assert budget.startswith("  cuda:0: total 5.5 GiB, free 5.5 GiB, headroom 512.0 MiB "), budget
    # what the doctor measures (the machine, the budgets, the self-test); the settings section shows each value
    # as the setting takes it (512MiB), and a probe's reason is its plugin's own words
    measured = re.split(r"^(?:settings|backends):$", out, flags=re.M)[0] + out.split("\nbudgets:\n", 1)[1]
    found = re.findall(r"-?\d[\d,.]*\s?(?:[kKMGTPE]i?B|bytes?)\b", measured)
    assert len(found) > 20, measured
    assert [f for f in found if not re.fullmatch(SIZE, f)] == [], measured


def test_the_panel_writes_sizes_as_format_size_does(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the panel's gb() is checked where it is")
    script = (ROOT / "membackend" / "_comfyui" / "web" / "membackend_panel.js").read_text()
    body = script[script.index("const SIZE_UNITS"):script.index("function ago(")]
    values = [0, 1, 640, 1024, 1536, 512 << 20, 6 << 30, 5632 << 20, 6 * 10**9, -(3 << 30), 1536 << 40,
              5000 << 50]
    probe = tmp_path / "probe.js"
    probe.write_text(body + f"\nconsole.log(JSON.stringify({json.dumps(values)}.map(gb)));\n")
    out = subprocess.run([node, str(probe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [format_size(v) for v in values]


# --------------------------------------------------------------------------- the headroom's source, one way

OWN_RULE = re.compile(r"(?:platform|backend) [a-z][a-z0-9_]*'s own rule(?: \(.+\))?")


@pytest.mark.parametrize("profile, platform", [("wddm-6gb", "cuda_wddm"), ("rocm-win-2gpu", "rocm_windows"),
                                               ("gb10-128gb", "unified_gb10"), ("strix-halo-128gb", "rocm_linux"),
                                               ("h200", None)])
def test_every_platforms_own_headroom_reads_one_way(membackend_simulated, profile, platform):
    s = membackend_simulated(profile, _platforms()[platform] if platform else None)
    for device in s.devices():
        assert OWN_RULE.fullmatch(s.headroom_in_force(device)[1]), s.headroom_in_force(device)


def test_every_backends_own_headroom_reads_one_way(membackend_simulated):
    from membackend._backends.aimdo import AimdoBackend
    from membackend._backends.host import HostBackend
    from membackend._session import Session

    host = HostBackend(page_size=2 << 20)
    assert OWN_RULE.fullmatch(host.own_headroom(membackend.Device("cpu", 0), 1 << 30)[1])
    assert OWN_RULE.fullmatch(AimdoBackend().own_headroom(membackend.Device("cuda", 0), 1 << 30)[1])
    from membackend._backends.vmm import VmmBackend

    vmm_session = membackend_simulated("h200")
    overridden = VmmBackend(driver=vmm_session.backend.driver, headroom=1 << 30).own_headroom(membackend.Device("cuda", 0), 8 << 30)
    assert overridden == (1 << 30, "backend vmm's own rule (an override of 1.0 GiB)")

    class Plain(HostBackend):  # a backend without own_headroom: the session names its budget's
        own_headroom = None  # type: ignore[assignment]

    s = Session(Plain(page_size=2 << 20), machine=vmm_session.machine)
    try:
        assert OWN_RULE.fullmatch(s.headroom_in_force("cpu")[1]), s.headroom_in_force("cpu")
    finally:
        s.close()


# --------------------------------------------------------------------------- the README's first screen


def test_the_readmes_first_screen_says_who_it_is_for_and_its_two_commands_come_before_any_table():
    text = (ROOT / "README.md").read_text()
    first = text.split("\n\n", 2)[1]  # the paragraph under the title
    assert first.startswith("**For** "), first
    lines = text.splitlines()
    setup = next(i for i, line in enumerate(lines) if line.startswith("scripts/setup"))
    test = next(i for i, line in enumerate(lines) if line.startswith("scripts/test"))
    table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert setup < test < table and setup < 30, (setup, test, table)
