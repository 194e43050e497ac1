"""Warm start (runtime/warm.py, ``LLM.warm``) over the fake backend: warmed prompts make the next request that
starts like one a hit with the same tokens as a cold run, on K/V alone and on a hybrid row (states kept at the
block boundary); bad entries, a cache that is off and a budget too small are one-line errors naming the entry."""

import json

import pytest

from fake_backend import make_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.prefix_cache import PrefixCache  # noqa: E402
from decodert.runtime.warm import read_warm_file  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
SYSTEM = "the quick brown fox jumps over the lazy dog. hello world, this is a tiny test corpus for decodert. " * 2


def _llm(states=False, budget=1 << 20):
    llm = make_llm(chat_template=CHATML, eos=[0], max_seq=256, states=states)
    llm.prefix_cache = PrefixCache(llm.backend, budget, 8, state_every=16)
    return llm


@pytest.mark.parametrize("states", [False, True])
def test_warmed_chat_prefix_is_a_hit_with_the_cold_tokens(states):
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "and then?"}]
    cold = _llm(states).chat(ask, max_new_tokens=8, temperature=0)
    assert cold.metrics.cached_tokens == 0
    llm = _llm(states)
    system_ids = llm.prepare(ask[:1], chat=True).ids
    held = llm.warm([ask[:1], "hello world"])
    assert held[0] == len(system_ids) // 8 * 8 and held[0] > 0, held
    warm = llm.chat(ask, max_new_tokens=8, temperature=0)
    assert warm.token_ids == cold.token_ids
    # the warm prompt ends with the generation prompt, which the longer chat does not share: up to the system message
    assert warm.metrics.cached_tokens >= (len(system_ids) - 1) // 8 * 8 - 8 > 0, warm.metrics
    prompt = llm.generate("hello world and more words after it", max_new_tokens=4, temperature=0)
    assert prompt.token_ids == _llm(states).generate("hello world and more words after it", max_new_tokens=4,
                                                     temperature=0).token_ids


def test_tools_render_into_the_warmed_prefix():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    template = "{% if tools %}{{ tools | tojson }}{% endif %}" + CHATML
    llm = make_llm(chat_template=template, eos=[0], max_seq=256)
    llm.prefix_cache = PrefixCache(llm.backend, 1 << 20, 8)
    sys_msg = [{"role": "system", "content": SYSTEM}]
    assert llm.warm([{"messages": sys_msg, "tools": tools}])[0] > 0
    ask = sys_msg + [{"role": "user", "content": "weather?"}]
    with_tools = llm.chat(ask, tools=tools, max_new_tokens=2, temperature=0)
    without = llm.chat(ask, max_new_tokens=2, temperature=0)
    assert with_tools.metrics.cached_tokens > len(llm.prepare(sys_msg, chat=True).ids) // 2
    assert without.metrics.cached_tokens == 0  # the tools come first in this template: no shared prefix without them


def test_bad_entries_and_settings_are_one_line_errors():
    llm = _llm()
    cases = [([""], "warm entry 0: the prompt is empty"), ([3], "warm entry 0: expected a prompt string"),
             (["ok", {"prompt": "a", "messages": []}], "warm entry 1: give exactly one of"),
             ([{"prompt": "a", "tools": []}], "'tools' goes with 'messages'"),
             ([{"messages": [{"role": "user", "content": "x"}], "seed": 1}], "unknown key 'seed'"),
             ([[{"role": 1}]], "warm entry 0: chat message 0 must be a dict"),
             (["word " * 400], "warm entry 0 has"), ([{"prompt": "a", "adapter": "sql"}], "unknown adapter 'sql'"),
             ("a prompt", "non-empty list"), ([], "non-empty list")]
    for items, message in cases:
        with pytest.raises(DecodertError, match=message) as e:
            llm.warm(items)
        assert "\n" not in str(e.value)
    assert len(llm.prefix_cache) == 0  # nothing ran
    llm.prefix_cache = None
    with pytest.raises(DecodertError, match="prefix cache, which is off"):
        llm.warm(["hello"])


def test_a_budget_too_small_for_every_entry_is_an_error():
    llm = _llm(budget=8 * 8 * 3)  # three blocks of 8 tokens (8 bytes a token in the fake)
    texts = [SYSTEM, "hello world, this is a tiny test corpus for decodert. " * 3]
    with pytest.raises(DecodertError, match=r"warm entry 0: \d+ of its \d+ whole-block tokens stayed"):
        llm.warm(texts)


def test_warm_files(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}]
    (tmp_path / "w.json").write_text(json.dumps(["hello", msgs, {"messages": msgs, "tools": []}]))
    entries = read_warm_file(tmp_path / "w.json")
    assert [(e.chat, e.where) for e in entries] == [(False, f"{tmp_path / 'w.json'}: entry {n}") for n in (1,)] + [
        (True, f"{tmp_path / 'w.json'}: entry {n}") for n in (2, 3)]
    (tmp_path / "w.jsonl").write_text(json.dumps("hello") + "\n\n" + json.dumps(msgs) + "\n")
    assert [e.where.rsplit(": ", 1)[1] for e in read_warm_file(tmp_path / "w.jsonl")] == ["line 1", "line 3"]
    llm = _llm()
    assert len(llm.warm(read_warm_file(tmp_path / "w.jsonl"))) == 2
    bad = [("w.jsonl", '"ok"\n{"prompt": 1}\n', "w.jsonl: line 2: 'prompt' must be a non-empty string"),
           ("w.jsonl", '"ok"\n{oops\n', "w.jsonl: line 2: not JSON"),
           ("w.json", '{"prompt": "a"}', "expected a JSON array of entries"),
           ("w.json", "[]", "no entries to warm"), ("w.json", "[\"a\", 2]", "w.json: entry 2: expected a prompt")]
    for name, text, message in bad:
        (tmp_path / name).write_text(text)
        with pytest.raises(DecodertError, match=message):
            read_warm_file(tmp_path / name)
    with pytest.raises(DecodertError, match="nope.json: cannot read it"):
        read_warm_file(tmp_path / "nope.json")
    (tmp_path / "w.jsonl").write_text(json.dumps("word " * 400) + "\n")
    with pytest.raises(DecodertError, match="w.jsonl: line 1 has"):  # the model's check names the file's line
        llm.warm(read_warm_file(tmp_path / "w.jsonl"))
