"""Warm start: prompts prefilled into the prefix cache before the first request, so that request is a hit.

    llm.warm(["You are a helpful assistant.", [{"role": "system", "content": "..."}]])   # -> tokens cached each
    llm.warm(read_warm_file("warm.jsonl"))                                             # `decodert serve --warm`

An entry is one of:

    "text"                                    a prompt, encoded as a completion prompt is (BOS as the manifest says)
    [{"role": ..., "content": ...}, ...]      chat messages, rendered with the chat template as a chat request is
                                              (with the generation prompt), so a later chat that starts with
                                              them reuses their K/V
    {"prompt": "text"}                        the same as the string
    {"messages": [...], "tools": [...],       chat messages with the options a request renders them with: tools
     "enable_thinking": bool,                 (OpenAI function tools: a request with the same tools renders the
     "chat_template_kwargs": {...},           same prefix), enable_thinking, chat_template_kwargs, and the LoRA
     "adapter": "name"}                       adapter the K/V are computed under

The file (``read_warm_file``): ``*.jsonl``, one entry a line (blank lines skipped); any other name, one JSON
array of entries. A bad entry is a one-line DecodertError naming the file and the entry (its line in a
JSONL file), before anything runs. Then every entry is prefilled (one run of the engine, one token
generated and dropped: only the prompt's K/V is stored), and what the cache then holds is checked: an
entry whose whole blocks did not all stay (the budget is too small for them all, or the cache is off) is
an error too, never a server that says it is warm and is not. For a hybrid model a prompt stops at its last
block boundary, where its states are kept (runtime/prefix_cache.py), as a request's would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from decodert.errors import DecodertError

ENTRY_KEYS = ("prompt", "messages", "tools", "enable_thinking", "chat_template_kwargs", "adapter")


@dataclass(frozen=True)
class WarmEntry:
    """One prompt to prefill: text or chat messages, the chat options, and how errors name it."""

    source: Any  # a prompt string, or a list of chat messages
    chat: bool
    options: Mapping[str, Any] = field(default_factory=dict)  # tools, enable_thinking, chat_template_kwargs, adapter
    where: str = "warm entry"


def entry(item: Any, where: str) -> WarmEntry:
    """A prompt string, a list of chat messages or an entry object -> WarmEntry (DecodertError naming ``where``)."""
    if isinstance(item, WarmEntry):
        return item
    if isinstance(item, str):
        if not item:
            raise DecodertError(f"{where}: the prompt is empty")
        return WarmEntry(item, False, {}, where)
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
        return WarmEntry(_messages(item, where), True, {}, where)
    if not isinstance(item, Mapping):
        raise DecodertError(f"{where}: expected a prompt string, a list of chat messages or an object with "
                            f"'prompt' or 'messages', got {type(item).__name__}")
    unknown = sorted(set(item) - set(ENTRY_KEYS))
    if unknown:
        raise DecodertError(f"{where}: unknown key {unknown[0]!r}; an entry takes {', '.join(ENTRY_KEYS)}")
    if ("prompt" in item) == ("messages" in item):
        raise DecodertError(f"{where}: give exactly one of 'prompt' or 'messages'")
    options = {k: item[k] for k in ENTRY_KEYS[2:] if k in item}
    if "tools" in options and not isinstance(options["tools"], list):
        raise DecodertError(f"{where}: 'tools' must be a list of tool definitions")
    if "adapter" in options and not isinstance(options["adapter"], str):
        raise DecodertError(f"{where}: 'adapter' must be the name of a loaded LoRA adapter")
    if "prompt" in item:
        if set(options) - {"adapter"}:
            raise DecodertError(f"{where}: {sorted(set(options) - {'adapter'})[0]!r} goes with 'messages', not 'prompt'")
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise DecodertError(f"{where}: 'prompt' must be a non-empty string")
        return WarmEntry(item["prompt"], False, options, where)
    return WarmEntry(_messages(item["messages"], where), True, options, where)


def _messages(value: Any, where: str) -> list:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value \
            or not all(isinstance(m, Mapping) for m in value):
        raise DecodertError(f"{where}: chat messages must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    return list(value)


def read_warm_file(path: str | Path) -> list[WarmEntry]:
    """The entries of a warm file (see the module docstring); DecodertError naming the file and the entry."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise DecodertError(f"{path}: cannot read it: {reason}") from None
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                out.append(entry(_json(line, f"{path}: line {n}"), f"{path}: line {n}"))
    else:
        items = _json(text, str(path))
        if not isinstance(items, list):
            raise DecodertError(f"{path}: expected a JSON array of entries (or a .jsonl file, one entry a line), "
                                f"got a JSON {type(items).__name__}")
        out = [entry(item, f"{path}: entry {n}") for n, item in enumerate(items, 1)]
    if not out:
        raise DecodertError(f"{path}: no entries to warm")
    return out


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DecodertError(f"{where}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def warm(llm: Any, items: Sequence[Any]) -> list[int]:
    """Prefill every entry into ``llm``'s prefix cache (one run) -> the tokens of each the cache now holds.
    DecodertError: a bad entry (named), the cache off, or an entry whose whole blocks did not all stay."""
    if isinstance(items, (str, Mapping)) or not isinstance(items, Sequence) or not items:
        raise DecodertError("warm takes a non-empty list of prompts, chat message lists or entries")
    entries = [entry(item, f"warm entry {i}") for i, item in enumerate(items)]
    prefix = llm.prefix_cache
    if prefix is None:
        raise DecodertError("warm start fills the prefix cache, which is off (prefix_cache_mb=0 / --prefix-cache-mb 0)")
    seqs, lengths = [], []
    for e in entries:
        try:
            prepared = llm.prepare(e.source, e.where, e.chat, max_new_tokens=1, temperature=0, **e.options)
            seqs.append(llm.engine.sequence(prepared))
        except DecodertError as err:
            message = str(err)
            raise DecodertError(message if message.startswith(e.where) else f"{e.where}: {message}") from None
        lengths.append(len(prepared.ids))
    llm.run(seqs)
    cache = llm.engine.cache
    stateful = bool(cache is not None and cache.has_state)
    held = []
    for e, seq, n in zip(entries, seqs, lengths):
        want = n // prefix.block_tokens * prefix.block_tokens
        got = prefix.reach(seq.prompt, stateful, _tag(llm, seq))
        if got < want:
            raise DecodertError(f"{e.where}: {got} of its {want} whole-block tokens stayed in the prefix cache "
                                f"({prefix.budget_bytes / 2**20:.1f} MiB for {len(entries)} entries); raise "
                                "--prefix-cache-mb (prefix_cache_mb=) or warm fewer prompts")
        held.append(got)
    return held


def _tag(llm: Any, seq: Any) -> int:
    """The adapter load tag a sequence's K/V were keyed under (0: the base model)."""
    adapter = getattr(seq, "adapter", None)
    return int(adapter[1]) if isinstance(adapter, tuple) else 0
