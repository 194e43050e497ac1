"""decodert ops, each defined once: schema, numpy reference, reference ONNX body (and kernels/ plugins where
they have them); catalog.py imports them all so they register."""
