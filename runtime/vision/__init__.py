"""Images in: decoding and limits (images.py), the checkpoint's preprocessing (preprocess.py), image
tokens keyed by the pixels (tokens.py) and the vision graph with its embedding store (encoder.py)."""
