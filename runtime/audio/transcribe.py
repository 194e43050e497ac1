"""The transcription request of an audio LLM, and the reading of its answer: Qwen3-ASR's as
Qwen3ASRProcessor.apply_transcription_request writes it, or an instruction's (``style``, the manifest's
``audio.transcription``: Qwen2-Audio and Gemma 4, which have no transcription API in their processors).

    messages, prefill = transcription_messages(clip, rate, language="en", prompt="hot words")
    language, text = parse_transcription(raw)        # "language English<asr_text>hello" -> ("English", "hello")

The prompt: a system turn with ``prompt`` (context or hot words) when given, a user turn with the one audio part,
and the assistant's turn opened by the generation prompt; a forced language is written after it as
``language <Name><asr_text>``, so the model writes only the text (otherwise it names the language itself).

With ``style = {"instruction": text}`` (models/families/qwen2_audio.py ``TRANSCRIPTION``): the system turn as
above, a user turn of the audio part and ``text``, the generation prompt; the answer is the transcription as it
is (stripped). Such a prompt forces no language: a ``language`` is refused in one line, unless the style also
has ``"instruction_language"``, a template of the instruction for a forced one, ``{language}`` its name
(models/families/gemma4.py ``TRANSCRIPTION``: "Transcribe the following speech segment in {language}.").
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from decodert.errors import DecodertError

MARKER = "<asr_text>"
# the language names Qwen3-ASR was trained with in "language <Name>", by ISO code
LANGUAGES = {
    "ar": "Arabic", "yue": "Cantonese", "zh": "Chinese", "cs": "Czech", "da": "Danish", "nl": "Dutch",
    "en": "English", "fil": "Filipino", "fi": "Finnish", "fr": "French", "de": "German", "el": "Greek",
    "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "mk": "Macedonian", "ms": "Malay", "fa": "Persian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "es": "Spanish", "sv": "Swedish", "th": "Thai", "tr": "Turkish", "vi": "Vietnamese",
}


def language_name(language: str | None) -> str | None:
    """An ISO code or a name -> the name the model was trained with (None: the model detects it)."""
    if language is None or language == "":
        return None
    if not isinstance(language, str):
        raise DecodertError(f"language must be a string, got {type(language).__name__}")
    by_name = {name.lower(): name for name in LANGUAGES.values()}
    name = LANGUAGES.get(language.lower()) or by_name.get(language.lower())
    if name is None:
        raise DecodertError(f"language {language!r} is not one this model was trained with "
                            f"({', '.join(sorted(LANGUAGES))} or their names)")
    return name


def transcription_messages(clip: np.ndarray, rate: int, language: str | None = None, prompt: str | None = None,
                           style: Mapping[str, Any] | None = None) -> tuple[list[dict], str]:
    """(the chat messages of a transcription request, the text that follows the generation prompt)."""
    if prompt is not None and not isinstance(prompt, str):
        raise DecodertError(f"prompt must be a string, got {type(prompt).__name__}")
    style = style or {}
    instruction, forced = style.get("instruction"), style.get("instruction_language")
    if instruction is not None and language not in (None, ""):
        if forced is None:
            raise DecodertError(f"language {language!r} cannot be forced: this model's transcription prompt "
                                f"({instruction!r}) lets it detect the language itself")
        instruction = forced.format(language=language_name(language))
    name = language_name(language) if instruction is None else None
    messages: list[dict] = []
    if prompt is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": prompt}]})
    audio: list[dict] = [{"type": "audio", "audio": (clip, rate)}]
    messages.append({"role": "user", "content": audio + ([{"type": "text", "text": instruction}] if instruction else [])})
    return messages, (f"language {name}{MARKER}" if name is not None else "")


def collapse_repeats(text: str, times: int = 20, longest: int = 20) -> str:
    """Qwen3-ASR's clean-up of a looping answer: a character repeated more than ``times`` times in a row becomes one;
    then, scanning from the start, the first piece of 1..``longest`` characters that repeats ``times`` times in a row
    is kept once, its further repeats dropped, and the rest of the text cleaned the same way (texts shorter than
    2 ``times`` characters are left alone)."""
    out, i = [], 0
    while i < len(text):  # runs of one character
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(text[i] if j - i > times else text[i:j])
        i = j
    return _collapse_pieces("".join(out), times, longest)


def _collapse_pieces(s: str, times: int, longest: int) -> str:
    n = len(s)
    if n < 2 * times:
        return s
    i = 0
    kept = []
    while i <= n - 2 * times:
        for k in range(1, longest + 1):
            if i + k * times > n:
                break
            piece = s[i:i + k]
            if all(s[i + r * k:i + (r + 1) * k] == piece for r in range(1, times)):
                end = i + times * k
                while s[end:end + k] == piece and end + k <= n:
                    end += k
                return "".join(kept) + piece + _collapse_pieces(s[end:], times, longest)
        kept.append(s[i])
        i += 1
    return "".join(kept) + s[i:]


def parse_transcription(raw: str, forced: str | None = None,
                        style: Mapping[str, Any] | None = None) -> tuple[str | None, str]:
    """The model's answer -> (language, transcription): the text after ``<asr_text>``, stripped, and the name
    written before it ("language English"), or ``forced`` when the prompt wrote it; loops collapsed first
    (``collapse_repeats``), as Qwen3ASRProcessor's parse does. An instruction ``style``: the answer stripped."""
    if (style or {}).get("instruction") is not None:
        return forced, raw.strip()
    raw = collapse_repeats(raw.strip())
    if MARKER not in raw:
        return forced, raw.strip()
    head, text = raw.split(MARKER, 1)
    head = head.strip()
    language = head[len("language"):].strip() if head.lower().startswith("language") else None
    return (language or forced), text.strip()
