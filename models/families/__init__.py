"""One file per model family; ``decodert.models.registry`` walks this package (docs/ARCHITECTURE.md)."""
