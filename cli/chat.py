"""``decodert chat OUT``: a streaming chat REPL over a session (runtime/chat/session.py).

The conversation's K/V stays in the session's cache row, so a turn prefills only what it adds.
It never ends on a full context: by default the oldest turns are dropped, with a one-line
notice (``--overflow error`` refuses the turn instead, and /undo or /reset go on). Answers go
to stdout; the banner, notices, command replies and the stats line go to stderr. On a terminal
the input line has readline editing and a history kept in $DECODERT_CACHE/chat_history.
``/save FILE`` writes the conversation and its K/V to a file (runtime/chat/saved.py) that ``--resume FILE``
reads back in a later ``decodert chat``: its next answer is the one this chat would have given. A /save that
fails says why in one line and the chat goes on (a file already there is kept whole); a --resume file that is
damaged, of another model or of another K/V type (without --convert-kv) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from decodert.cli import common, inputs
from decodert.errors import DecodertError

HISTORY_FILE = "chat_history"
HISTORY_LINES = 1000
COMMANDS = (("/help", "this help"), ("/reset", "forget the conversation (the system message stays)"),
            ("/undo", "forget the last message and its answer"),
            ("/image FILE", "attach an image to the next message (vision-language models)"),
            ("/video DIR", "attach a video (a folder of frame images, or FILE,FILE,...) to the next message (Qwen-VL)"),
            ("/audio FILE", "attach an audio clip (WAV, FLAC, ...) to the next message (audio models: Qwen3-ASR)"),
            ("/save FILE", "save the conversation and its cache to FILE (decodert chat MODEL --resume FILE)"),
            ("/exit", "quit (also /quit, Ctrl-D)"))
EXIT = ("/exit", "/quit", "/bye")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="interactive chat with an exported model",
                              description="Streaming chat REPL: Ctrl-C stops an answer, /help lists the commands "
                                          "(/reset forgets, /undo drops the last turn), /exit or Ctrl-D quits.")
    p.add_argument("out", metavar="MODEL", type=Path, help=common.MODEL_HELP)
    add_chat_flags(p)
    p.add_argument("--resume", type=Path, metavar="FILE",
                   help="go on with a conversation saved by /save (its system message and --overflow come with it)")
    p.add_argument("--convert-kv", action="store_true",
                   help="with --resume: take a file saved with another float K/V type (fp32, fp16, bf16) of the same "
                        "model, converted as the cache stores values")
    common.add_common(p, json_flag=False)
    p.set_defaults(func=run_chat)


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    """--system and --overflow (chat and run)."""
    p.add_argument("--system", help="system message")
    p.add_argument("--overflow", choices=("truncate", "error"), default="truncate",
                   help="when the conversation fills the context: drop the oldest turns (default) or refuse the turn")
    add_image_flag(p)


def add_image_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", action="append", default=[], metavar="FILE", type=Path,
                   help="an image for the (first) message, repeatable (vision-language models)")
    p.add_argument("--video", action="append", dest="image", metavar="FRAME_DIR_OR_FILES", type=Frames.parse,
                   help="a video for the (first) message: a folder of frame images (in name order) or frame files "
                        "separated by commas; repeatable (Qwen2.5-VL, Qwen3-VL)")
    p.add_argument("--video-fps", type=float, metavar="FPS",
                   help="the rate the --video frames were taken at (default: 24, as transformers assumes)")
    p.add_argument("--audio", action="append", dest="image", metavar="FILE", type=Clip.parse,
                   help="an audio clip (WAV, FLAC, OGG) for the (first) message, repeatable (audio models: Qwen3-ASR); "
                        "`decodert run MODEL --audio FILE` without --prompt prints its transcription")


class Clip(type(Path())):  # type: ignore[misc]
    """An --audio / /audio file (a Path that is known to be an audio clip)."""

    @classmethod
    def parse(cls, value: str) -> "Clip":
        if not Path(value).is_file():
            raise argparse.ArgumentTypeError(f"{value!r} is not an audio file")
        return cls(value)


FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class Frames(list):
    """The frame files of one --video (a list of paths) and their rate."""

    fps: float | None = None

    @classmethod
    def parse(cls, value: str) -> "Frames":
        if not value.strip():
            raise argparse.ArgumentTypeError("no folder or frame files given")
        path = Path(value)
        if path.is_dir():
            frames = cls(sorted(f for f in path.iterdir() if f.suffix.lower() in FRAME_SUFFIXES))
            if not frames:
                raise argparse.ArgumentTypeError(f"{value} holds no frame images ({', '.join(FRAME_SUFFIXES)})")
            return frames
        frames = cls(Path(f) for f in value.split(",") if f)
        missing = [str(f) for f in frames if not f.is_file()]
        if not frames or missing:
            raise argparse.ArgumentTypeError(f"{missing[0] if missing else value!r} is not a frame file or a folder")
        return frames


def media(args: argparse.Namespace) -> list:
    """--image files and --video Frames in command-line order, the videos given --video-fps."""
    items = list(getattr(args, "image", None) or [])
    for item in items:
        if isinstance(item, Frames):
            item.fps = getattr(args, "video_fps", None)
    return items


def user_message(text: str, images: list) -> dict:
    """A user message: the text, after the images (paths) and videos (Frames) when there are any."""
    if not images:
        return {"role": "user", "content": text}
    parts = [{"type": "video", "video": list(i), "fps": i.fps} if isinstance(i, Frames) else
             {"type": "audio", "audio": Path(i)} if isinstance(i, Clip) else
             {"type": "image", "image": Path(i)} for i in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def run_chat(args: argparse.Namespace) -> int:
    return chat_loop(common.load(args.out, args.backend, args.verify, common.draft_of(args), args.placement), args)


def chat_loop(llm, args: argparse.Namespace, read: Callable[[str], str] | None = None, out: TextIO | None = None,
              err: TextIO | None = None, banner: bool | None = None) -> int:
    """The REPL (see the module docstring); returns the exit code. ``read``: how a line is read
    (default: stdin, bounded by the model's max_seq; cli/inputs.py). ``banner``: print the
    commands first (default: when stdin is a terminal; piped input gets answers only)."""
    out, err = out or sys.stdout, err or sys.stderr
    system = inputs.argv_text(getattr(args, "system", None), "--system")
    session = resume(llm, args, err) if getattr(args, "resume", None) is not None else \
        llm.session(system=system, overflow=getattr(args, "overflow", "truncate"))
    history = None if read is not None else LineHistory.open()
    read = read or inputs.line_reader(llm.max_seq)
    pending = media(args)  # images and videos for the next message (--image, --video, /image)
    if (sys.stdin.isatty() if banner is None else banner):
        print(f"decodert chat: context {llm.max_seq} tokens. /help for commands, /reset forgets, /exit or Ctrl-D quits, "
              "Ctrl-C stops an answer.", file=err)
    try:
        while True:
            try:
                line = read(">>> ")
            except EOFError:
                out.write("\n")
                return 0
            except KeyboardInterrupt:
                out.write("\n")
                continue
            except DecodertError as e:  # a line that is not UTF-8 text: typed again on a terminal
                if not sys.stdin.isatty():
                    raise
                print(f"decodert: error: {e}", file=err)
                continue
            text = line.strip()
            if text.startswith("/") and not text.startswith("//"):
                if command(session, text, err, pending):
                    return 0
            elif text:
                turn(session, line.lstrip()[1:] if text.startswith("//") else line, args, out, err, pending)
    finally:
        if history is not None:
            history.save()


def resume(llm, args: argparse.Namespace, err: TextIO):
    """The session of ``--resume FILE`` (DecodertError, one line: a bad file, --system beside it)."""
    if getattr(args, "system", None) is not None:
        raise DecodertError("--resume takes the saved session's system message; drop --system")
    session = llm.resume(args.resume, convert_kv=getattr(args, "convert_kv", False))
    print(f"[resumed {len(session.history)} messages ({session.cached_tokens} tokens cached) from {args.resume}]", file=err)
    return session


def save(session, value: str, err: TextIO) -> None:
    """/save FILE: write the session, or say in one line why not (the chat goes on either way)."""
    if not value:
        print("[/save needs a file name]", file=err)
        return
    try:
        size = session.save(Path(value).expanduser())
    except DecodertError as e:
        print(f"decodert: error: {e}", file=err)
        return
    print(f"[saved {len(session.history)} messages ({session.cached_tokens} tokens cached, {size} bytes) to {value}]",
          file=err)


def command(session, text: str, err: TextIO, pending: list | None = None) -> bool:
    """Run a /command locally (never sent to the model); True to quit. ``pending``: images for the next message."""
    name = text.split()[0].lower()
    if name in EXIT:
        return True
    if name in ("/image", "/video", "/audio") and pending is not None:
        attach(name, text.split(None, 1)[1].strip() if len(text.split(None, 1)) > 1 else "", err, pending)
        return False
    if name == "/save":
        save(session, text.split(None, 1)[1].strip() if len(text.split(None, 1)) > 1 else "", err)
        return False
    if name == "/help":
        width = max(len(c) for c, _ in COMMANDS)
        lines = [f"  {c:<{width}}  {what}" for c, what in COMMANDS]
        lines += ["  Ctrl-C stops an answer; start a message with // to send one that begins with /"]
        print("\n".join(lines), file=err)
    elif name == "/reset":
        session.reset()
        print("[conversation cleared]", file=err)
    elif name == "/undo":
        try:
            session.undo()
            print("[removed the last message and its answer]", file=err)
        except DecodertError:
            print("[nothing to undo]", file=err)
    else:
        print(f"unknown command {name}; /help lists the commands (// sends a message that begins with /)", file=err)
    return False


def attach(name: str, value: str, err: TextIO, pending: list) -> None:
    """/image FILE, /audio FILE or /video DIR_OR_FILES: queue it for the next message, or say in one line why not."""
    if name == "/audio":
        try:
            pending.append(Clip.parse(value))
            print(f"[audio {pending[-1].name} will go with the next message]", file=err)
        except argparse.ArgumentTypeError:
            print(f"[/audio needs an audio file; {value!r} is not one]" if value else "[/audio needs a file]", file=err)
        return
    if name == "/image":
        path = Path(value) if value else None
        if path is None or not path.is_file():
            print(f"[/image needs an image file; {path} is not one]" if path else "[/image needs a file]", file=err)
        else:
            pending.append(path)
            print(f"[image {path.name} will go with the next message]", file=err)
        return
    try:
        pending.append(Frames.parse(value))
        print(f"[video of {len(pending[-1])} frames will go with the next message]", file=err)
    except argparse.ArgumentTypeError as e:
        print(f"[/video needs a folder of frame images or frame files: {e}]", file=err)


def turn(session, message: str, args: argparse.Namespace, out: TextIO, err: TextIO, pending: list | None = None) -> None:
    """Stream one answer. Ctrl-C keeps what was shown; an error is one line and the chat goes on."""
    before = session.last_turn
    stream = None
    try:
        text = inputs.argv_text(message, "the message") or ""
        images = list(pending or [])
        if pending:
            pending.clear()  # the images go with this message
        stream = session.stream_chat(user_message(text, images) if images else text, **common.sampling_kwargs(args))
        if session.dropping:  # said before the answer: the turns are gone as it starts
            out.flush()
            print(dropped_note(session.dropping, session.llm.max_seq), file=err, flush=True)
        common.print_stream(stream, out)
    except KeyboardInterrupt:
        if stream is not None:
            stream.close()
        out.write(" [interrupted]")
    except DecodertError as e:
        if stream is not None:
            stream.close()
            out.write("\n")
        print(f"decodert: error: {e}", file=err)
        return
    out.write("\n")
    info = session.last_turn
    if info is not None and info is not before:
        for note in notes(info, session, args):
            print(note, file=err)
    common.print_stats(args, stream)


def notes(info, session, args: argparse.Namespace) -> list[str]:
    """One line per thing the user should know after the turn: an answer cut short (dropped turns
    are said before the answer, ``dropped_note``)."""
    max_seq = session.llm.max_seq
    out = []
    if info.cut_by == "max_new_tokens":
        limit = getattr(args, "max_new_tokens", None)
        out.append(f"[answer cut at --max-new-tokens {limit}]" if limit else "[answer cut by --max-new-tokens]")
    elif info.cut_by == "context":
        then = ("the oldest turns are dropped on the next message" if session.overflow == "truncate"
                else "/undo or /reset to go on")
        out.append(f"[answer cut: the context of {max_seq} tokens is full; {then}]")
    return out


def dropped_note(dropped: int, max_seq: int) -> str:
    s = "s" if dropped > 1 else ""
    return f"[the conversation filled the context of {max_seq} tokens: dropped the {dropped} oldest turn{s}]"


class LineHistory:
    """readline editing and a persistent input history, on a terminal only."""

    def __init__(self, readline: Any, path: Path) -> None:
        self.readline, self.path = readline, path

    @classmethod
    def open(cls) -> "LineHistory | None":
        if not sys.stdin.isatty():
            return None
        try:
            import readline  # input() edits lines and recalls history once this is imported
        except ImportError:  # a Python built without it
            return None
        from decodert.export.fetch import cache_dir

        path = cache_dir() / HISTORY_FILE
        try:
            readline.read_history_file(str(path))
        except OSError:  # none yet, or unreadable: start empty
            pass
        readline.set_history_length(HISTORY_LINES)
        return cls(readline, path)

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(str(self.path))
        except OSError:  # a read-only cache loses the history, not the chat
            pass
