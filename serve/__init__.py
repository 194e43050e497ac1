"""decodert's OpenAI-compatible HTTP server: ``decodert serve`` (docs/SERVING.md).

One floor above runtime: the app (app.py) puts HTTP requests into one runtime Engine
(runtime/engine/thread.py, over the LLM's engine), which batches them; server.py runs it on uvicorn, ray_app.py on Ray Serve.
Needs the ``serve`` extra (fastapi, uvicorn, sse-starlette, prometheus-client).
"""
