"""The speculative decoding flags of the CLI, in a subprocess: ``generate``/``chat``/``run``
--speculative ngram|draft, --draft ARTIFACT, --draft-len K, and ``decodert bench --speculative``.

Greedy output with the flags must be the plain greedy output, token for token; bad combinations
are one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decodert.errors import DecodertError
from decodert.export.pipeline import export_model

ROOT = Path(__file__).resolve().parents[3]  # the folder holding the decodert package
PROMPT = "one two three four one two three four one two three"


@pytest.fixture(scope="module")
def art(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("spec-cli") / "art"
    export_model(tiny_checkpoint("llama"), out, max_seq=96, max_batch=2, progress=False)
    return out


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decodert", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})


def generate(art: Path, *flags: str) -> dict:
    proc = cli("generate", str(art), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "40", "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_generate_flags_give_the_plain_greedy_tokens(art):
    plain = generate(art)
    for flags in (["--speculative", "ngram"], ["--speculative", "ngram", "--draft-len", "3"],
                  ["--draft", str(art)], ["--speculative", "draft", "--draft", str(art), "--draft-len", "2"]):
        got = generate(art, *flags)
        assert got["token_ids"] == plain["token_ids"], flags
    drafted = generate(art, "--draft", str(art), "--draft-len", "4")  # the target as its own draft: all accepted
    # (how many steps verify is the adaptive width's choice from measured costs; the first one does)
    assert drafted["metrics"]["accepted_per_step"] > 1.0 and drafted["metrics"]["acceptance_rate"] > 0.9


def test_streamed_generate_prints_the_speculation_stats(art):
    proc = cli("generate", str(art), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "30", "--draft", str(art))
    assert proc.returncode == 0, proc.stderr
    assert "tok/step" in proc.stderr and "accepted" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--speculative", "draft"], "--speculative draft needs --draft ARTIFACT"),
    (["--draft-len", "3"], "--draft-len needs --speculative ngram|draft"),
    (["--speculative", "ngram", "--draft-len", "0"], "--draft-len must be >= 1"),
])
def test_bad_flag_combinations_are_one_line(art, flags, message):
    proc = cli("generate", str(art), "--prompt", PROMPT, *flags)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bench_speculative_reports_tokens_per_step_and_acceptance(art, tmp_path):
    report = tmp_path / "b.json"
    proc = cli("bench", str(art), "--prompt-len", "8", "--gen", "24", "--repeats", "1", "--warmup", "0",
               "--batch", "1,2", "--speculative", "draft", "--draft", str(art), "--json", str(report))
    assert proc.returncode == 0, proc.stderr
    assert "tok/step" in proc.stdout and "speculative draft" in proc.stdout
    data = json.loads(report.read_text())
    assert data["speculative"] == "draft" and [r["batch"] for r in data["results"]] == [1, 2]
    first, second = data["results"]  # the target drafting for itself: every draft is accepted, and
    # the adaptive width drafts until it has measured the draft's cost (the target's own), then stops
    assert first["accepted_per_step"] > 1.0 and first["acceptance_rate"] == 1.0
    assert second["accepted_per_step"] >= 1.0 and second["acceptance_rate"] in (0.0, 1.0)
    assert first["decode_tps"]["median"] > 0 and second["decode_tps"]["median"] > 0
    proc = cli("bench", str(art), "--prompt-len", "8", "--gen", "24", "--repeats", "1", "--speculative", "ngram")
    assert proc.returncode == 0 and "tok/step" in proc.stdout, proc.stderr
    bad = cli("bench", str(art), "--prompt-len", "8", "--gen", "24", "--speculative", "draft")
    assert bad.returncode == 2 and "--speculative draft needs --draft ARTIFACT" in bad.stderr
    proc = cli("bench", str(art), "--prompt-len", "8", "--gen", "24", "--repeats", "1", "--warmup", "0",
               "--speculative", "ngram", "--draft-len", "2")
    assert proc.returncode == 0 and "tok/step" in proc.stdout and "1 repeat after" in proc.stdout, proc.stderr


def test_serve_and_bench_take_the_same_speculation_flags(art):
    """--speculative, --draft ARTIFACT and --draft-len K on run, generate, chat, serve and bench alike."""
    from decodert.cli import build_parser
    from decodert.cli.serve import options

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("run", "generate", "chat", "serve", "bench"):
        text = " ".join(sub[command].format_help().split())
        assert "--draft ARTIFACT" in text and "--draft-len K" in text, command
    args = parser.parse_args(["serve", str(art), "--speculative", "ngram", "--draft-len", "3"])
    assert options(args).speculative.draft_len == 3 and options(args).speculative.method == "ngram"
    args = parser.parse_args(["serve", str(art), "--draft-len", "3"])
    with pytest.raises(DecodertError, match="--draft-len needs --speculative"):
        options(args)
