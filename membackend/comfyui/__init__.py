"""The ComfyUI adapter: the only part of membackend that knows ComfyUI's and comfy-aimdo's names.

* :mod:`.install` — ``membackend comfyui install|uninstall <folder>``;
* :mod:`.startup` — the prestartup script's work: selection, one log line, the
  ``comfy_aimdo.control.init_devices`` wrapper; every patch reversible (G6);
* :mod:`.vbar` — the drop-in facade for ``comfy_aimdo.model_vbar`` backed by the
  residency manager;
* :mod:`.streams` — fence tokens for the copies ComfyUI's cast path queues (G2);
* :mod:`.buffers` — drop-ins for comfy-aimdo's ``VRAMBuffer``, ``HostBuffer``, ``ModelMMAP``;
* :mod:`.status` — the ``GET /membackend/status`` route.

See ``docs/comfyui.md``.
"""
