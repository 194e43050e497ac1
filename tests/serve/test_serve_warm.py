"""`decodert serve --warm FILE`: the prompts are in the prefix cache before the server says it is serving, so the
first request is a hit (usage cached_tokens > 0) with the tokens of a cold run; a bad file is one line, exit 2."""

import json
import signal

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from serve_helpers import export_tiny, start_cli  # noqa: E402

from decodert.runtime.llm import LLM  # noqa: E402

SYSTEM = ("You are a careful assistant. The quick brown fox jumps over the lazy dog; hello world, "
          "this is the system prompt that every request begins with. ")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("serve-warm"), max_batch=2, max_seq=256)


def test_the_first_request_after_a_warm_start_is_a_hit(art, tmp_path):
    warm = tmp_path / "warm.jsonl"
    warm.write_text(json.dumps([{"role": "system", "content": SYSTEM}]) + "\n" + json.dumps("hello there") + "\n")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a fox?"}]
    with LLM.load(art, prefix_cache_mb=0) as cold:
        want = cold.chat(messages, max_new_tokens=12, temperature=0)
    proc, url = start_cli(art, "--warm", str(warm))
    try:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": "art", "messages": messages, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, body["usage"]
        assert body["choices"][0]["message"]["content"] == want.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_a_bad_warm_file_is_one_line_exit_2(art, tmp_path, capsys):
    from decodert.cli import main

    (tmp_path / "bad.jsonl").write_text('"fine"\n{"messages": "not a list"}\n')
    (tmp_path / "long.json").write_text(json.dumps(["fine", "word " * 400]))
    cases = [(("--warm", tmp_path / "bad.jsonl"), "bad.jsonl: line 2: chat messages must be a non-empty list"),
             (("--warm", tmp_path / "long.json"), "long.json: entry 2 has"),
             (("--warm", tmp_path / "none.json"), "none.json: cannot read it"),
             (("--warm", tmp_path / "long.json", "--prefix-cache-mb", "0"), "--warm fills the prefix cache")]
    for args, message in cases:
        assert main(["serve", str(art), "--port", "0", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decodert: error: ") and message in err and len(err.strip().splitlines()) == 1, (args, err)
