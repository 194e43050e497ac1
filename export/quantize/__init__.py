"""Weight quantization: block int4/int8 rounding, exact GGUF block transcoding, weight layouts."""
