"""The ComfyUI adapter: the only part of membackend that knows ComfyUI's and comfy-aimdo's names.

Every module of the adapter, in the order ComfyUI meets them:

* :mod:`.install` — ``membackend comfyui install|uninstall <folder>``;
* :mod:`.startup` — the prestartup script's work: selection, one log line, the
  ``comfy_aimdo.control.init_devices`` wrapper; every patch reversible (G6);
* :mod:`.runtime` — the one running adapter of the process: its session and residency manager, the G6
  guard around every patched function, and its parts:

  * :mod:`.headroom` — ComfyUI's memory flags at start-up and the live headroom (the VRAM cap);
  * :mod:`.unloads` — full unloads, put off while a page is pinned, and the models ComfyUI dropped;
  * :mod:`.delegates` — Hook delegates go with their owner's unload (G5);
  * :mod:`.journal` — model names, the per-load lines, the unloads and idle give-backs;
  * :mod:`.history` — each device's reserved, resident and committed bytes over the last minutes;
  * :mod:`.lines` — one membackend log line, and sizes as a person reads them;
  * :mod:`.links` — what a part reads of the runtime as it is now, handed to it when the runtime builds it
    (no part holds the runtime);
* :mod:`.patches` — reversible attribute patches, each remembering the original;
* :mod:`.wiring` — the table of patch points on ``comfy.model_management``, ``ModelPatcherDynamic`` and the
  prompt queue's idle point, and the facade's installation over comfy-aimdo's names;
* :mod:`.vbar` — the drop-in facade for ``comfy_aimdo.model_vbar`` backed by the
  residency manager;
* :mod:`.buffers` — drop-ins for comfy-aimdo's ``VRAMBuffer``, ``HostBuffer``, ``ModelMMAP``;
* :mod:`.aimdo_newer` — drop-ins for the comfy-aimdo 0.5.5 and 0.6.0 names that would reach a served device;
* :mod:`.aimdo_names` — every public comfy-aimdo name and its one answer (served, left to aimdo, kept out),
  for the tests and the docs; never imported at start-up;
* :mod:`.streams` — fence tokens for the copies ComfyUI's cast path queues (G2);
* :mod:`.keepwarm` — keep warm by budget (G4): the dynamic patchers ComfyUI still holds, watched weakly;
* :mod:`.classic` — a wholly resident model on ComfyUI's classic path (no fault or unpin per weight per step),
  back on the dynamic path before any of its pages can go;
* :mod:`.reuse` — weights already in VRAM are never read again: a dropped model's weights kept as cache, and a
  read of the same file's bytes copied on the device from them;
* :mod:`.status` — the ``GET /membackend/status`` route, where its answer is built, and the memory panel's
  headroom route (the panel's script is ``web/membackend_panel.js``).

What the adapter adds to ComfyUI's start-up is measured outside it, in the lab
(:mod:`membackend.lab.startup_cost`): the adapter imports neither the lab nor the kit.

See ``docs/comfyui.md``.
"""
