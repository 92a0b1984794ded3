"""flashgen's version: one place, importable by every layer without importing the rest."""

__version__ = "0.1.0"
