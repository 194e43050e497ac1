"""Unbounded or undecodable CLI inputs end in one line (cli/inputs.py), and long API text is
refused before tokenizing or tokenized in pieces (runtime/validate.py encode_text)."""

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_backend import make_llm, make_tokenizer  # noqa: E402

from decodert.cli import main as cli_main  # noqa: E402
from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime import validate  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _one_line_error(capsys, argv, match):
    t0 = time.monotonic()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and err.count("\n") == 1 and match in err, err
    return time.monotonic() - t0


@pytest.mark.parametrize("source", ["/dev/zero", "/dev/urandom", "big"])
def test_endless_or_huge_prompt_files_are_refused(samples, tmp_path, capsys, source):
    if source == "big":
        source = tmp_path / "big.txt"
        source.write_bytes(b"hello world " * (50 * 1024 * 1024 // 12))  # 50 MB of text
    seconds = _one_line_error(capsys, ["generate", str(samples["art"]), "--prompt-file", str(source)],
                              "is longer than 65,536 bytes")  # max_seq 256 x 256 bytes
    assert seconds < 60


def test_stdin_is_bounded_too(samples, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x" * 70000)))
    _one_line_error(capsys, ["generate", str(samples["art"]), "--prompt-file", "-"], "longer than")


def test_non_utf8_prompt_file_and_argv(samples, tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    _one_line_error(capsys, ["generate", str(samples["art"]), "--prompt-file", str(bad)],
                    "is not UTF-8 text (byte 0xe9 at offset 3)")
    _one_line_error(capsys, ["generate", str(samples["art"]), "--prompt", "ab\udcff"],  # how Python passes argv 0xff
                    "--prompt is not valid UTF-8 (byte 0xff at character 2)")
    _one_line_error(capsys, ["generate", str(samples["art"]), "--prompt-file", str(tmp_path)], "not a file")


def test_non_utf8_argv_in_a_real_process(samples):
    proc = subprocess.run([sys.executable, "-m", "decodert", "generate", os.fsencode(samples["art"]), "--prompt",
                           b"caf\xe9", "--max-new-tokens", "2"], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "LC_ALL": "C.UTF-8"})
    assert proc.returncode == 2 and b"--prompt is not valid UTF-8 (byte 0xe9" in proc.stderr, proc.stderr[-800:]


def test_a_valid_prompt_file_still_works(samples, tmp_path, capsys):
    good = tmp_path / "p.txt"
    good.write_text("hello world")
    assert cli_main(["generate", str(samples["art"]), "--prompt-file", str(good), "--max-new-tokens", "3",
                     "--greedy", "--no-stats"]) == 0


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_output_paths_are_checked_before_the_work(samples, tmp_path, capsys, monkeypatch, flag):
    from decodert.tools import bench

    monkeypatch.setattr(bench, "bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    _one_line_error(capsys, ["bench", str(samples["art"]), flag, "/nonexistent/dir/x.out"],
                    "folder /nonexistent/dir does not exist")
    _one_line_error(capsys, ["bench", str(samples["art"]), flag, str(tmp_path)], "is a folder")


def test_api_text_far_beyond_max_seq_is_refused_before_tokenizing():
    llm = make_llm()
    llm.tokenizer = None  # tokenizing would fail loudly
    with pytest.raises(DecodertError, match="characters: far more than the"):
        llm.generate("x" * (llm.max_seq * validate.CHARS_PER_TOKEN + 1))
    assert llm.backend.calls == []


def test_long_text_is_tokenized_in_pieces_with_the_same_ids(monkeypatch):
    tok = make_tokenizer()
    text = ("the quick brown fox jumps over the lazy dog.\nhello world, " * 40)[:2000]
    whole = tok.encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(validate, "PIECE", 50)
    assert validate.encode_text(tok, text, max_seq=10_000) == whole


@pytest.mark.parametrize("data,match", [(b"x" * 70000, "longer than 65,536 bytes"),
                                        (b"caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 3)")])
def test_chat_lines_from_a_pipe_are_bounded_and_decoded(samples, capsys, monkeypatch, data, match):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    _one_line_error(capsys, ["chat", str(samples["art"]), "--max-new-tokens", "2"], match)


def test_chat_from_a_pipe_still_answers(samples, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n/exit\n")))
    assert cli_main(["chat", str(samples["art"]), "--max-new-tokens", "2", "--greedy", "--no-stats"]) == 0
