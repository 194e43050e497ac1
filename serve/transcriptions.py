"""``POST /v1/audio/transcriptions`` (OpenAI's transcription API) over ``LLM.prepare_transcription``
(runtime/audio/transcribe.py), run on the engine thread as a chat request is.

    multipart/form-data: file (the clip: WAV, FLAC, OGG; soundfile decodes it), model, response_format
    json (default) | text | verbose_json, language (an ISO code or a name the model knows), prompt (context for
    the system turn), temperature (0: greedy)
    -> json {"text"};  text: the text alone (text/plain);  verbose_json {"task": "transcribe", "language",
       "duration", "text", "segments": [one segment over the clip], "usage"}

Every bad input is a one-line 400: not multipart, no file, not audio, too long or too big (the LLM's audio
limits; a body over the server's --max-body-mb is a 413 first), an unknown language or response_format
(srt / vtt: no timestamps are made), a model without audio.onnx.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from decodert.errors import DecodertError
from decodert.runtime.audio.clips import load_audio
from decodert.runtime.audio.transcribe import language_name
from decodert.runtime.audio.whisper import WhisperLLM
from decodert.serve.jobs import Choice, Job
from decodert.serve.protocol import ApiError

FORMATS = ("json", "text", "verbose_json")
MAX_TOKENS = 448  # generated tokens at most (Whisper's decoder length; a 30 s clip is ~100 words)


def add_routes(app: FastAPI, engine: Any, config: Any, metrics: Any, check_model: Any) -> None:
    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        received = time.perf_counter()
        form = await _form(request)
        check_model(_field(form, "model", required=True))
        fmt = _field(form, "response_format") or "json"
        if fmt not in FORMATS:
            raise ApiError(400, f"response_format {fmt!r} is not one of {', '.join(FORMATS)} (no timestamps are made)",
                           param="response_format")
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "the form needs a 'file' part holding the audio", param="file")
        data = await upload.read()
        language, prompt = _field(form, "language"), _field(form, "prompt")
        params: dict[str, Any] = {"max_new_tokens": MAX_TOKENS}
        temperature = _field(form, "temperature")
        if temperature is not None:
            try:
                params["temperature"] = float(temperature)
            except ValueError:
                raise ApiError(400, f"temperature must be a number, got {temperature!r}", param="temperature") from None
        llm = engine.llm
        if isinstance(llm, WhisperLLM):  # an encoder-decoder artifact: its own runtime, off the text engine's thread
            return await _whisper(llm, data, fmt, language, params)

        def prepare() -> tuple[Any, float]:
            try:
                if llm.audio is None:
                    raise DecodertError(llm.no_audio())
                rate = llm.audio.sampling_rate
                clip = load_audio(data, "file", llm.audio_limits, rate)
                prepared = llm.prepare_transcription((clip, rate), None, language, prompt, **params)
                return engine.sequence(prepared), clip.size / rate
            except DecodertError as e:
                raise ApiError(400, str(e), param="language" if str(e).startswith("language") else "file") from None

        seq, seconds = await run_in_threadpool(prepare)
        job = Job(engine, [Choice(seq, 0)], received, metrics.observe)
        request.state.job = job  # the request log's token counts (serve/guard.py)
        result = (await job.collect(request))[0]
        forced = language_name(language) if language else None
        detected, text = llm.read_transcription(result.text, forced)
        return _reply(fmt, text, detected, seconds, result.token_ids, params.get("temperature", 0.0),
                      result.metrics.prompt_tokens)


async def _whisper(llm: WhisperLLM, data: bytes, fmt: str, language: str | None, params: dict) -> Response:
    """The transcription of a Whisper artifact (runtime/audio/whisper.py): 30 s windows, greedy, each window up
    to the model's generation_config max_length (not MAX_TOKENS)."""
    params = {k: v for k, v in params.items() if k != "max_new_tokens"}

    def run() -> tuple[Any, float]:
        try:
            clip = load_audio(data, "file", llm.audio_limits, llm.sampling_rate)
            return llm.transcribe((clip, llm.sampling_rate), None, language or None, **params), clip.size / llm.sampling_rate
        except DecodertError as e:
            param = "language" if str(e).startswith("language") else "temperature" if "temperature" in str(e) else "file"
            raise ApiError(400, str(e), param=param) from None

    result, seconds = await run_in_threadpool(run)
    return _reply(fmt, result.text.strip(), language, seconds, result.token_ids, 0.0, 0)


def _reply(fmt: str, text: str, language: str | None, seconds: float, token_ids: Any, temperature: float,
           input_tokens: int) -> Response:
    """The transcription in ``response_format`` ``fmt``: text, json, or verbose_json (one segment over the clip)."""
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "json":
        return JSONResponse({"text": text})
    duration = round(seconds, 3)
    return JSONResponse({"task": "transcribe", "language": (language or "").lower() or None, "duration": duration,
                         "text": text, "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text,
                                                     "tokens": list(token_ids), "temperature": temperature}],
                         "usage": {"type": "tokens", "input_tokens": input_tokens, "output_tokens": len(token_ids),
                                   "total_tokens": input_tokens + len(token_ids)}})


async def _form(request: Request) -> Any:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "send the audio as multipart/form-data (a 'file' part and a 'model' field)", param="file")
    try:
        return await request.form()
    except Exception as e:  # a malformed multipart body
        raise ApiError(400, f"the multipart body is not readable ({type(e).__name__})", param="file") from None


def _field(form: Any, name: str, required: bool = False) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a text field", param=name)
    if required and not value:
        raise ApiError(400, f"the form needs a '{name}' field", param=name)
    return value
