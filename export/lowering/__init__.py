"""The graph recipe and one lowering per target (ort, trt, portable), with the checks of what they emit."""
