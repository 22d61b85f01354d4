"""``python -m membackend``: the ``membackend`` command (``doctor``, ``backends``, ``budget``, ``comfyui``,
``replay``, ``bench``) where the console script is not on ``PATH``."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
