"""``POST /v1/audio/transcriptions`` (OpenAI's transcription API) over ``LLM.prepare_transcription``
(runtime/audio/transcribe.py), run on the engine thread as a chat request is.

    multipart/form-data: file (the clip: WAV, FLAC, OGG; soundfile decodes it), model, response_format
    json (default) | text | verbose_json | srt | vtt, timestamp_granularities[] (segment), language (an ISO code
    or a name the model knows), prompt (context for the system turn), temperature (0: greedy)
    -> json {"text"};  text: the text alone (text/plain);  verbose_json {"task": "transcribe", "language",
       "duration", "text", "segments": [...], "usage"};  srt / vtt: the segments as subtitles (text/plain)

Segments: a Whisper artifact with timestamp tokens decodes with timestamps (runtime/audio/timestamps.py) for
verbose_json (OpenAI's default granularity is the segment), srt and vtt, each segment {id, seek, start, end,
text, tokens, temperature, avg_logprob, compression_ratio, no_speech_prob: null (not computed)}; any other model
answers verbose_json with one segment over the clip, and srt, vtt or timestamp_granularities[]=segment with a
one-line 400. Every bad input is a one-line 400: not multipart, no file, not audio, too long or too big (the LLM's
audio limits; a body over the server's --max-body-mb is a 413 first), an unknown language, response_format or
granularity (word timestamps are not made), a model without audio.onnx.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from decodert.errors import DecodertError
from decodert.runtime.audio.clips import load_audio
from decodert.runtime.audio.transcribe import language_name, parse_transcription
from decodert.runtime.audio.whisper import WhisperLLM
from decodert.serve.jobs import Choice, Job
from decodert.serve.api_error import ApiError

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
SUBTITLES = ("srt", "vtt")
MAX_TOKENS = 448  # generated tokens at most (Whisper's decoder length; a 30 s clip is ~100 words)


def add_routes(app: FastAPI, engine: Any, config: Any, metrics: Any, check_model: Any) -> None:
    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        received = time.perf_counter()
        form = await _form(request)
        check_model(_field(form, "model", required=True))
        fmt = _field(form, "response_format") or "json"
        if fmt not in FORMATS:
            raise ApiError(400, f"response_format {fmt!r} is not one of {', '.join(FORMATS)}", param="response_format")
        segment = _granularities(form, fmt)
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
            return await _whisper(llm, data, fmt, language, params, segment)
        if segment or fmt in SUBTITLES:
            what = f"response_format {fmt!r}" if fmt in SUBTITLES else "timestamp_granularities segment"
            raise ApiError(400, f"{what} needs timestamps, which only a Whisper artifact makes",
                           param="response_format" if fmt in SUBTITLES else "timestamp_granularities")

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
        detected, text = parse_transcription(result.text, forced, llm.audio.transcription)
        return _reply(fmt, text, detected, seconds, result.token_ids, params.get("temperature", 0.0),
                      result.metrics.prompt_tokens)


async def _whisper(llm: WhisperLLM, data: bytes, fmt: str, language: str | None, params: dict,
                   segment: bool) -> Response:
    """The transcription of a Whisper artifact (runtime/audio/whisper.py): 30 s windows, greedy, each window up
    to the model's generation_config max_length (not MAX_TOKENS); timestamped for subtitles, for segments asked
    for, and for verbose_json when the model has timestamp tokens."""
    params = {k: v for k, v in params.items() if k != "max_new_tokens"}
    params["timestamps"] = segment or fmt in SUBTITLES or (fmt == "verbose_json" and llm.has_timestamps)

    def run() -> tuple[Any, float]:
        try:
            clip = load_audio(data, "file", llm.audio_limits, llm.sampling_rate)
            return llm.transcribe((clip, llm.sampling_rate), None, language or None, **params), clip.size / llm.sampling_rate
        except DecodertError as e:
            text = str(e)
            param = ("language" if text.startswith("language") else "temperature" if "temperature" in text
                     else "response_format" if "timestamp" in text else "file")
            raise ApiError(400, text, param=param) from None

    result, seconds = await run_in_threadpool(run)
    segments = None if result.segments is None else [
        {"id": i, "seek": s.seek, "start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
         "tokens": list(s.token_ids), "temperature": s.temperature, "avg_logprob": s.avg_logprob,
         "compression_ratio": s.compression_ratio, "no_speech_prob": None} for i, s in enumerate(result.segments)]
    return _reply(fmt, result.text.strip(), language, seconds, result.token_ids, 0.0, 0, segments)


def _reply(fmt: str, text: str, language: str | None, seconds: float, token_ids: Any, temperature: float,
           input_tokens: int, segments: list[dict] | None = None) -> Response:
    """The transcription in ``response_format`` ``fmt``: text, json, verbose_json (``segments``, else one segment
    over the clip), or srt / vtt subtitles of ``segments``."""
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "json":
        return JSONResponse({"text": text})
    if fmt in SUBTITLES:
        return PlainTextResponse(subtitles(fmt, segments or []))
    duration = round(seconds, 3)
    if segments is None:
        segments = [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "tokens": list(token_ids),
                     "temperature": temperature}]
    return JSONResponse({"task": "transcribe", "language": (language or "").lower() or None, "duration": duration,
                         "text": text, "segments": segments,
                         "usage": {"type": "tokens", "input_tokens": input_tokens, "output_tokens": len(token_ids),
                                   "total_tokens": input_tokens + len(token_ids)}})


def subtitles(fmt: str, segments: list[dict]) -> str:
    """SubRip (numbered cues, ``00:00:01,500``) or WebVTT (a ``WEBVTT`` header, ``00:00:01.500``) of segments."""
    mark = "," if fmt == "srt" else "."
    cues = []
    for i, s in enumerate(segments):
        when = f"{_clock(s['start'], mark)} --> {_clock(s['end'], mark)}"
        cues.append(f"{i + 1}\n{when}\n{s['text'].strip()}\n" if fmt == "srt" else f"{when}\n{s['text'].strip()}\n")
    body = "\n".join(cues)
    return body if fmt == "srt" else "WEBVTT\n\n" + body


def _clock(seconds: float, mark: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{mark}{ms % 1000:03d}"


def _granularities(form: Any, fmt: str) -> bool:
    """timestamp_granularities[] (the openai SDK's field name; OpenAI's API: verbose_json only) -> whether segments
    were asked for; word timestamps are refused."""
    asked = [v for name in ("timestamp_granularities[]", "timestamp_granularities") for v in form.getlist(name)]
    for value in asked:
        if not isinstance(value, str) or value not in ("segment", "word"):
            raise ApiError(400, f"timestamp_granularities {value!r} is not one of segment, word",
                           param="timestamp_granularities")
        if value == "word":
            raise ApiError(400, "timestamp_granularities word is not supported (segment is)",
                           param="timestamp_granularities")
    if asked and fmt != "verbose_json":
        raise ApiError(400, f"timestamp_granularities needs response_format verbose_json, not {fmt!r}",
                       param="timestamp_granularities")
    return bool(asked)


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
