"""The decodert version, in a module of its own on the artifact floor: the exporter stamps it into every
manifest without importing the package root (which would close a loop: root -> LLM -> export -> root)."""

__version__ = "0.1.0"
