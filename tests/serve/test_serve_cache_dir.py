"""`decodert serve --cache-dir`: a restarted server answers a prompt an earlier one saw with usage cached_tokens from
the disk tier and the same tokens; /metrics shows the tier; its flags' errors are one line."""

import signal

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from serve_helpers import export_tiny, start_cli  # noqa: E402

PROMPT = " ".join(f"word{i} and more text" for i in range(12))  # about 200 tokens: several blocks


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("serve-cache-dir"), max_batch=2, max_seq=512)


def _ask(url):
    body = {"model": "art", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _serve_once(art, cache_dir):
    proc, url = start_cli(art, "--cache-dir", str(cache_dir), "--cache-dir-gb", "0.5")
    try:
        reply = _ask(url)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    return reply, metrics


def test_a_restarted_server_answers_from_the_disk_tier(art, tmp_path):
    cold, _ = _serve_once(art, tmp_path / "cd")
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm, metrics = _serve_once(art, tmp_path / "cd")
    cached, prompt = warm["usage"]["prompt_tokens_details"]["cached_tokens"], warm["usage"]["prompt_tokens"]
    assert cached > 0 and cached >= prompt - 32  # every whole block but the one holding the last token
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert "decodert_prefix_cache_disk_hits 1.0" in metrics
    assert f"decodert_prefix_cache_disk_hit_tokens {float(cached)}" in metrics


def test_cache_dir_flag_errors_are_one_line(art, tmp_path, capsys):
    from decodert.cli import main

    cases = [(("--cache-dir-gb", "1"), "give --cache-dir DIR too"),
             (("--cache-dir", str(tmp_path), "--cache-dir-gb", "0"), "--cache-dir-gb must be a finite number > 0"),
             (("--cache-dir", str(tmp_path), "--cache-dir-gb", "nan"), "--cache-dir-gb must be a finite number > 0"),
             (("--cache-dir", str(tmp_path), "--prefix-cache-mb", "0"), "--prefix-cache-mb 0 turns that cache off")]
    for args, message in cases:
        assert main(["serve", str(art), "--port", "0", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decodert: error: ") and message in err and len(err.strip().splitlines()) == 1, (args, err)
