"""The model families, one file each in this folder, found by convention (``decodert.models.registry`` walks
them), not grouped in sub-folders by one trait (docs/ARCHITECTURE.md)."""
