"""The transcription request of an audio LLM (Qwen3-ASR), as Qwen3ASRProcessor.apply_transcription_request writes it,
and the reading of its answer.

    messages, prefill = transcription_messages(clip, rate, language="en", prompt="hot words")
    language, text = parse_transcription(raw)        # "language English<asr_text>hello" -> ("English", "hello")

The prompt: a system turn with ``prompt`` (context or hot words) when given, a user turn with the one audio part,
and the assistant's turn opened by the generation prompt; a forced language is written after it as
``language <Name><asr_text>``, so the model writes only the text (otherwise it names the language itself).
"""

from __future__ import annotations

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


def transcription_messages(clip: np.ndarray, rate: int, language: str | None = None,
                           prompt: str | None = None) -> tuple[list[dict], str]:
    """(the chat messages of a transcription request, the text that follows the generation prompt)."""
    if prompt is not None and not isinstance(prompt, str):
        raise DecodertError(f"prompt must be a string, got {type(prompt).__name__}")
    name = language_name(language)
    messages: list[dict] = []
    if prompt is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": prompt}]})
    messages.append({"role": "user", "content": [{"type": "audio", "audio": (clip, rate)}]})
    return messages, (f"language {name}{MARKER}" if name is not None else "")


def parse_transcription(raw: str, forced: str | None = None) -> tuple[str | None, str]:
    """The model's answer -> (language, transcription): the text after ``<asr_text>``, stripped, and the name
    written before it ("language English"), or ``forced`` when the prompt wrote it."""
    if MARKER not in raw:
        return forced, raw.strip()
    head, text = raw.split(MARKER, 1)
    head = head.strip()
    language = head[len("language"):].strip() if head.lower().startswith("language") else None
    return (language or forced), text.strip()
