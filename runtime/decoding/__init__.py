"""The decode loop: sequences and their verbs (prefill, decode step), sampling, continuous batching, the engine thread, metrics."""
