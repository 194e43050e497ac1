"""The artifact folder: manifest, files and hashes, weights file, atomic destination, inspect."""
