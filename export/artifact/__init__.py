"""Writing an artifact folder, on the export side: the atomic destination, ``decodert inspect``, the plugin-free
rewrite of a ``--plugins`` export. The contract itself (manifest, graph I/O, weights file) is decodert/artifact/."""
