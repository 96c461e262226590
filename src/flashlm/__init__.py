"""flashlm: run language models larger than memory by streaming sparse MLPs from an SSD store."""

__version__ = "0.1.0"

from .config import FlashConfig  # noqa: E402
from .integrations.transformers import register as _register  # noqa: E402
from .patching import patch, reset_stats, stats, unpatch  # noqa: E402
from .store import Store, convert  # noqa: E402

_register()

__all__ = ["FlashConfig", "Store", "__version__", "convert", "patch", "reset_stats", "stats", "unpatch"]
