"""membackend's ComfyUI adapter inside a real ComfyUI tree (see docs/real-comfyui-tests.md).

Skipped unless ``MEMBACKEND_COMFYUI`` names a ComfyUI tree; the Python that runs it is
``MEMBACKEND_COMFYUI_PYTHON`` (default ``.venv-comfyui/bin/python``, built by
``scripts/comfyui-python``).
"""
