"""The model families, one file each, in groups by what their layers are: dense/ (attention only), moe/,
hybrid/ (attention beside recurrent layers), vision/ (a text model plus a vision tower).
``decodert.models.registry`` walks them (docs/ARCHITECTURE.md)."""
