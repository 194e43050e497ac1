"""The audio encoders' graphs: ``audio.onnx`` by encoder kind (graph.py ``BUILDERS``: the ``qwen3_asr`` kind there,
``whisper`` in whisper.py, ``gemma4`` in gemma4.py) and the pre-norm encoder layer they and Whisper's encoder-decoder
export share (encoder_layers.py)."""
