"""flashlm: run language models larger than memory by streaming sparse MLPs from an SSD store."""

from ._version import __version__
from .config import FlashConfig
from .integrations.transformers import register as _register
from .patching import patch, stats, unpatch
from .store import Store, convert

_register()

__all__ = ["FlashConfig", "Store", "__version__", "convert", "patch", "stats", "unpatch"]
