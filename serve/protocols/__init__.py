"""The wire protocols the server speaks, each translated onto the one engine path (serve/jobs.py, runtime/engine/):
OpenAI's completions and chat completions (requests.py: the bodies accepted; replies.py: the
bodies returned; logprobs.py), OpenAI's Responses API (responses_api.py, response_store.py), Anthropic's Messages
(anthropic.py), both of those over one chat turn (chat_run.py), embeddings (embeddings.py) and transcriptions
(transcriptions.py). The HTTP side (routes, guard, CORS, connections, metrics) is serve/'s own.
"""
