"""Run to run in the real tree: a second identical prompt loads no bytes the first did not.

The adapter takes over on the simulated H200 (``--cpu --enable-dynamic-vram``); the VAE round trip runs
once, again identically, and once more with another input colour (so ComfyUI's cache runs the VAE nodes
again). Between runs, membackend's status route (its loads: bytes copied into reservations) and ComfyUI's
own log (its ``Requested to load`` / ``loaded completely`` lines) must show no new load. On a CPU device no
model gets a VBAR in this tree, so what membackend loads is 0 throughout; ComfyUI's log is what shows a
reload there.
"""

from __future__ import annotations

import pytest

from . import harness

LOAD_LINES = ("Requested to load", "loaded completely", "loaded partially")


def _loads(output: str) -> list[str]:
    return [line for line in harness.log_lines(output) if any(k in line for k in LOAD_LINES)]


def test_a_second_identical_prompt_loads_nothing_the_first_did_not(trees, comfy_python, report):
    flags, env = ("--cpu", "--enable-dynamic-vram"), {"MEMBACKEND_SIM_PROFILE": "h200"}
    log = report.folder / "logs" / "run-to-run.log"
    found: dict[str, object] = {}
    with trees.scratch_copy(trees.node, "run-to-run") as tree, \
            harness.serve(tree, flags, env, python=comfy_python, log=log) as server:
        first = harness.vae_workflow(prefix="membackend_rc_r2r")
        server.run_prompt(first)
        _, st1 = server.get("/membackend/status")
        comfy1 = _loads(server.output())
        server.run_prompt(first)  # the same prompt again
        _, st2 = server.get("/membackend/status")
        comfy2 = _loads(server.output())
        changed = harness.vae_workflow(prefix="membackend_rc_r2r")
        changed["1"]["inputs"]["color"] = 0xCC6633  # the VAE runs again: its model must still be loaded
        server.run_prompt(changed)
        _, st3 = server.get("/membackend/status")
        comfy3 = _loads(server.output())
    found.update(first={"membackend_loaded": st1.get("loaded_bytes"), "comfy_load_lines": comfy1},
                 second={"membackend_loaded": st2.get("loaded_bytes"), "comfy_load_lines": comfy2[len(comfy1):]},
                 changed_input={"membackend_loaded": st3.get("loaded_bytes"),
                                "comfy_load_lines": comfy3[len(comfy2):]})
    report.put("run_to_run", found)
    assert st1["state"] == "running", st1
    assert st2["loaded_bytes"] == st1["loaded_bytes"], found
    assert [x for x in st2["loads"][len(st1["loads"]):] if x["loaded"]] == [], found
    assert comfy2 == comfy1, f"ComfyUI loaded a model again for an identical prompt: {comfy2[len(comfy1):]}"
    assert st3["loaded_bytes"] == st1["loaded_bytes"], found
    assert comfy3 == comfy2, f"ComfyUI loaded the VAE again when only the input changed: {comfy3[len(comfy2):]}"
    if not comfy1:
        pytest.skip("ComfyUI logged no model load at all for the first prompt here (nothing to compare with); "
                    f"membackend loaded {st1['loaded_bytes']} bytes")
