"""decodert's own CPU decode step (``native-cpu``, a placement candidate for the decode phase): a C library built at
first use (build.py) running every layer of a dense llama-family int4 decode step over the ort backend's cache (step.py)."""
