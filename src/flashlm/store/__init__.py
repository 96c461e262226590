"""flashlm.store: the SSD weight store — its format, conversion into it, and the tensor sources read."""

from .convert import add_kinds, convert
from .format import FORMAT_VERSION, KINDS, Store, mlp_content_sha256
from .reader import StoreReader
from .rowfile import ALIGNMENT, RowFile
from .sources import ModuleSource, SafetensorsSource, TensorSource

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "KINDS",
    "ModuleSource",
    "RowFile",
    "SafetensorsSource",
    "Store",
    "StoreReader",
    "TensorSource",
    "add_kinds",
    "convert",
    "mlp_content_sha256",
]
