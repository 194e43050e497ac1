"""``POST /v1/embeddings`` (OpenAI's embeddings API) over ``LLM.embed`` (runtime/embedding.py).

    {"model", "input": "text" | ["text", ...] | [id, ...] | [[id, ...], ...],
     "encoding_format": "float" (default) | "base64" (little-endian float32, as OpenAI), "dimensions": k}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...] | "base64"}],
        "model", "usage": {"prompt_tokens", "total_tokens"}}

Limits, each a one-line 400: at most MAX_ITEMS inputs and MAX_TOKENS tokens a request (OpenAI's), every input
within the model's max_seq and at least one token; ``dimensions`` where the model allows it (a matryoshka model:
1..d, else only d). A model exported without embed.onnx answers a 400 naming the export flag.

How it shares the model with generation: embed.onnx has its own ONNX Runtime session, and a call takes no engine
slot and no engine lock, so it runs in a worker thread while the EngineThread keeps stepping (on the CPU both
draw on the same cores; each embedding call is at most max_batch rows, and requests run one at a time, so the
decode steps between them wait for one call at most).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from decodert.errors import DecodertError, RequestError
from decodert.serve.api_error import ApiError

MAX_ITEMS = 2048  # inputs a request (OpenAI's limit)
MAX_TOKENS = 300_000  # tokens summed over a request's inputs (OpenAI's limit)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: Any  # checked by ``inputs``: pydantic's union errors would not say which form was meant
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None

    def check(self) -> None:
        self.inputs()
        if self.dimensions is not None and self.dimensions < 1:
            raise ApiError(400, f"dimensions must be a positive integer, got {self.dimensions}", param="dimensions")

    def inputs(self) -> list[Any]:
        """The inputs as a list: texts, or token id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ApiError(400, "input must be a string, a list of strings, a list of token ids or a list of lists "
                                "of token ids (non-empty)", param="input")
        if all(_is_id(t) for t in value):
            return [value]
        if len(value) > MAX_ITEMS:
            raise ApiError(400, f"input has {len(value)} items; at most {MAX_ITEMS} a request", param="input")
        for i, item in enumerate(value):
            if not (isinstance(item, str) or (isinstance(item, list) and all(_is_id(t) for t in item))):
                raise ApiError(400, f"input[{i}] must be a string or a list of token ids (all the same kind)",
                               param="input")
        if len({isinstance(item, str) for item in value}) > 1:
            raise ApiError(400, "input mixes strings and token id lists; send one kind a request", param="input")
        return value


def _is_id(value: Any) -> bool:
    return type(value) is int


class Embeddings:
    """The endpoint's work for one LLM: requests one at a time, each in a worker thread."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._turn: asyncio.Lock | None = None  # made on the event loop's first request

    async def respond(self, req: EmbeddingRequest) -> dict[str, Any]:
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            vectors, tokens = await run_in_threadpool(self._embed, req)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _embed(self, req: EmbeddingRequest) -> tuple[np.ndarray, int]:
        """(vectors [n, d], tokens) in a worker thread; the runtime's errors as one-line 400s."""
        try:
            embedder = self.llm.embedder
            ids = embedder.token_ids(req.inputs())
            tokens = sum(len(x) for x in ids)
            if tokens > MAX_TOKENS:
                raise ApiError(400, f"input has {tokens} tokens in all; at most {MAX_TOKENS} a request", param="input")
            return embedder.embed(ids, req.dimensions), tokens
        except RequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        except DecodertError as e:  # no embed.onnx in this artifact
            raise ApiError(400, f"this model does not serve embeddings: {e}", param="model",
                           code="model_not_supported") from None


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()
