"""Vision-language families (a text model plus a vision tower): one file per family."""
