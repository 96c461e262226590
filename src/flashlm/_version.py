"""The library's version, stamped into every store, calibration and saved config."""

__version__ = "0.1.0"
