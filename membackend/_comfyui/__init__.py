"""The ComfyUI adapter: the only part of membackend that knows ComfyUI's and comfy-aimdo's names.

* :mod:`.install` — ``membackend comfyui install|uninstall <folder>``;
* :mod:`.startup` — the prestartup script's work: selection, one log line, the
  ``comfy_aimdo.control.init_devices`` wrapper; every patch reversible (G6);
* :mod:`.wiring` — the patches on ``comfy.model_management`` and the prompt queue's idle point;
* :mod:`.vbar` — the drop-in facade for ``comfy_aimdo.model_vbar`` backed by the
  residency manager;
* :mod:`.streams` — fence tokens for the copies ComfyUI's cast path queues (G2);
* :mod:`.buffers` — drop-ins for comfy-aimdo's ``VRAMBuffer``, ``HostBuffer``, ``ModelMMAP``;
* :mod:`.status` — the ``GET /membackend/status`` route;
* :mod:`.startup_cost` — what the adapter adds to ComfyUI's start-up, as a ratio to ``import torch``.

See ``docs/comfyui.md``.
"""
