"""The chat REPL (cli/chat.py) over sessions: it never dies on a full context, says why an answer
ended early, handles /commands locally, and edits lines with readline on a terminal."""

import io
import os
import sys

import pytest

from fake_backend import make_llm  # noqa: E402

from decodert.cli import build_parser  # noqa: E402
from decodert.cli.chat import chat_loop  # noqa: E402

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}<|assistant|>"
LINES = ["hello world", "the quick brown fox", "jumps over the lazy dog", "this is a tiny test corpus"]


def _run(llm, lines, *flags):
    """Feed ``lines`` to the REPL, then EOF -> (exit code, stdout, stderr)."""
    args = build_parser().parse_args(["chat", "OUT", "--no-stats", "--greedy", *flags])
    feed = iter(lines)

    def read(_prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out, err = io.StringIO(), io.StringIO()
    code = chat_loop(llm, args, read=read, out=out, err=err, banner=True)
    return code, out.getvalue(), err.getvalue()


def _prefills(llm):
    return sum(1 for kind, _, _ in llm.backend.calls if kind == "prefill")


def test_banner_and_commands_are_local():
    llm = make_llm(chat_template=TEMPLATE, eos=[0])
    code, out, err = _run(llm, ["/help", "/HELP me", "/frobnicate", "/undo", "/reset", "/save"])
    assert code == 0 and _prefills(llm) == 0  # nothing reached the model
    banner = err.splitlines()[0]
    assert all(word in banner for word in ("/exit", "/reset", "Ctrl-C", "/help"))
    assert err.count("/undo") >= 2 and "unknown command /frobnicate" in err
    assert "[nothing to undo]" in err and "[conversation cleared]" in err and "[/save needs a file name]" in err
    assert out.strip() == ""


def test_undo_and_a_message_that_starts_with_a_slash():
    llm = make_llm(chat_template=TEMPLATE, eos=[0])
    sessions = []
    real = llm.session
    llm.session = lambda **kw: sessions.append(real(**kw)) or sessions[-1]
    code, _, err = _run(llm, ["hello world", "//usr/bin is a folder", "/undo"], "--max-new-tokens", "3")
    assert code == 0 and "[removed the last message and its answer]" in err
    assert [m["content"] for m in sessions[0].history if m["role"] == "user"] == ["hello world"]
    code, _, _ = _run(llm, ["//usr"], "--max-new-tokens", "3")
    assert [m["content"] for m in sessions[1].history if m["role"] == "user"] == ["/usr"]


def test_a_full_context_never_ends_the_chat():
    llm = make_llm(chat_template=TEMPLATE, max_seq=64)  # no eos: every answer runs to its limit
    code, out, err = _run(llm, LINES * 3, "--max-new-tokens", "12")
    assert code == 0 and "error" not in err
    assert "oldest turn" in err
    assert err.count("[answer cut at --max-new-tokens 12]") == 12  # every message was answered, to its limit


def test_an_answer_cut_by_the_context_says_so():
    llm = make_llm(chat_template=TEMPLATE, max_seq=48)
    _, _, err = _run(llm, ["hello world"], "--max-new-tokens", "200")
    assert "[answer cut: the context of 48 tokens is full; the oldest turns are dropped on the next message]" in err


def test_overflow_error_refuses_the_turn_and_goes_on():
    llm = make_llm(chat_template=TEMPLATE, max_seq=64)
    code, out, err = _run(llm, LINES * 2 + ["/reset", "hello world"], "--max-new-tokens", "12", "--overflow", "error")
    assert code == 0 and "decodert: error: the conversation needs" in err
    assert err.rstrip().endswith("[answer cut at --max-new-tokens 12]")  # after /reset the last message was answered


def test_readline_editing_and_history_in_a_terminal(tiny_checkpoint, tmp_path):
    """In a pty: the banner, up-arrow recalls the last line, the history file is written."""
    pexpect = pytest.importorskip("pexpect")
    from decodert.export.pipeline import export_model

    export_model(tiny_checkpoint("llama"), tmp_path / "art", target="ort", dtype="fp32", max_seq=64, max_batch=1,
                 progress=False)
    env = {**os.environ, "DECODERT_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    child = pexpect.spawn(sys.executable, ["-m", "decodert", "chat", str(tmp_path / "art"), "--greedy",
                                           "--max-new-tokens", "4", "--no-stats"], env=env, encoding="utf-8", timeout=120)
    try:
        child.expect_exact("/exit or Ctrl-D quits")
        child.expect_exact(">>> ")
        child.sendline("hello there")
        child.expect_exact(">>> ")
        child.send("\x1b[A")  # up arrow: the last line comes back, editable
        child.expect_exact("hello there")
        child.send("\x15/reset\r")  # Ctrl-U clears it; /reset instead
        child.expect_exact("[conversation cleared]")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    saved = (tmp_path / "cache" / "chat_history").read_text().splitlines()
    assert saved[-3:] == ["hello there", "/reset", "/exit"]


def test_the_dropped_turns_notice_comes_before_the_answer():
    """One stream for answers and notices (a terminal shows both): the notice precedes the answer it belongs to."""
    llm = make_llm(chat_template=TEMPLATE, max_seq=64)
    args = build_parser().parse_args(["chat", "OUT", "--no-stats", "--greedy", "--max-new-tokens", "12"])
    feed = iter(LINES * 2)

    def read(_prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    both = io.StringIO()
    assert chat_loop(llm, args, read=read, out=both, err=both, banner=False) == 0
    lines = both.getvalue().splitlines()
    dropped = [i for i, line in enumerate(lines) if "oldest turn" in line]
    assert dropped, lines
    for i in dropped:  # after the previous turn's last line comes the notice, then this turn's answer (not its notes)
        assert lines[i - 1] == "[answer cut at --max-new-tokens 12]", lines[i - 1: i + 2]
        assert not lines[i + 1].startswith("[answer cut"), lines[i - 1: i + 2]


def test_save_and_resume_through_the_command_line(tiny_checkpoint, tmp_path):
    """/save FILE in one `decodert chat`, --resume FILE in the next: its answer is the one the first chat would have
    given; a /save that fails is one line and the chat goes on; a bad --resume file is one line and exit 2."""
    import subprocess

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    art = tmp_path / "art"
    export_model(tiny_checkpoint("llama"), art, target="ort", dtype="fp32", max_seq=128, max_batch=1, progress=False)
    env = {**os.environ, "DECODERT_CACHE": str(tmp_path / "cache")}
    flags = ["--greedy", "--max-new-tokens", "6", "--no-stats"]

    def chat(lines, *extra):
        return subprocess.run([sys.executable, "-m", "decodert", "chat", str(art), *flags, *extra], input="\n".join(lines),
                              capture_output=True, text=True, env=env, timeout=300)

    saved = tmp_path / "chat.session"
    first = chat(["hello world", f"/save {tmp_path / 'no' / 'dir' / 'x.session'}", "the quick brown fox", f"/save {saved}"],
                 "--system", "be brief")
    assert first.returncode == 0, first.stderr
    failed = [line for line in first.stderr.splitlines() if line.startswith("decodert: error:")]
    assert len(failed) == 1 and "cannot write the session" in failed[0], first.stderr
    assert f"to {saved}]" in first.stderr and len(_answers(first.stdout)) == 2  # both questions answered
    second = chat(["jumps over the lazy dog"], "--resume", str(saved))
    assert second.returncode == 0 and "[resumed 5 messages" in second.stderr, second.stderr
    with LLM.load(art) as llm:
        live = llm.session(system="be brief")
        for q in ("hello world", "the quick brown fox"):
            live.chat(q, max_new_tokens=6, temperature=0)
        want = live.chat("jumps over the lazy dog", max_new_tokens=6, temperature=0).text
    assert _answers(second.stdout) == [want.strip()]
    saved.write_bytes(saved.read_bytes()[:-9])
    for extra, message in ((("--resume", str(saved)), "checksum mismatch"),
                           (("--resume", str(tmp_path / "none.session")), "cannot read the session"),
                           (("--resume", str(saved), "--system", "x"), "drop --system")):
        bad = chat(["hello"], *extra)
        assert bad.returncode == 2 and bad.stdout == "", bad
        assert bad.stderr.startswith("decodert: error: ") and message in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def _answers(stdout: str) -> list[str]:
    """The answers a piped `decodert chat` printed after its prompts."""
    return [part.strip() for part in stdout.split(">>> ") if part.strip()]
