"""``membackend._comfyui.startup.comfy_dynamic_vram`` answers ComfyUI's own ``enables_dynamic_vram()``.

One child process of the ComfyUI Python, with the real tree on ``sys.path``, parses each argument
list with ComfyUI's own parser and compares the two answers; the reason names the deciding flag as
typed.
"""

from __future__ import annotations

import pytest

from . import harness


@pytest.fixture(scope="module")
def answers(trees, comfy_python, report):
    got = harness.dynamic_vram_answers(trees.stock, python=comfy_python)
    report.put("comfy_dynamic_vram", got)
    return got


def test_comfy_dynamic_vram_matches_comfyui(answers) -> None:
    assert not answers.get("import_error"), f"cannot import comfy_dynamic_vram: {answers['import_error']}"
    problems = []
    for row in answers["cases"]:
        argv = row["argv"]
        if "error" in row or "ours" not in row:
            problems.append(f"{argv}: {row.get('error') or 'not a (bool, str) pair: ' + row.get('answer', '?')}")
            continue
        if not isinstance(row["ours"], bool) or not isinstance(row["reason"], str) or not row["reason"]:
            problems.append(f"{argv}: not a (bool, non-empty str) pair: {row.get('answer')}")
            continue
        if row["ours"] != row["comfy"]:
            problems.append(f"{argv}: membackend says {row['ours']}, ComfyUI's enables_dynamic_vram() {row['comfy']}")
        if "--enable-dynamic-vram" in argv:
            deciding = ["--enable-dynamic-vram"]
        elif not row["comfy"]:
            deciding = [a for a in argv if a in harness.DYNAMIC_OFF]
        else:
            deciding = []
        if deciding and not any(flag in row["reason"] for flag in deciding):
            problems.append(f"{argv}: the reason does not name {' or '.join(deciding)}: {row['reason']!r}")
    assert not problems, "\n".join(problems)
