"""Audio in: decoding, resampling and limits (clips.py), the checkpoint's log-mel features (features.py) and the
audio graph with its placement at the audio tokens (encoder.py)."""
