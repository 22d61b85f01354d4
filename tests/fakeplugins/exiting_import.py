"""A plugin module that calls sys.exit() when imported."""

import sys

sys.exit("this plugin refuses to load")
