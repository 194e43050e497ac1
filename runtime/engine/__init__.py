"""The engine that owns every run: requests (request.py), slots and admission (scheduler.py), how a step is
taken (strategy.py), the engine itself (engine.py), callers taking turns (runs.py), a server's thread (thread.py)."""
