"""What the model-running commands (generate, chat, run) share: sampling flags, loading, streaming."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from decodert.errors import DecodertError, MissingDependencyError

MODEL_DEFAULT = "default: the model's (`decodert inspect` shows them)"


def add_common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    """Sampling flags, --backend, --full-verify, --json and --no-stats.

    A sampling flag left out takes the model's default (manifest["sampling"]; SmolLM2-Instruct:
    temperature 0.2, top_p 0.5), exactly as in the Python API; a flag given overrides it.
    """
    g = p.add_argument_group("sampling (a flag left out takes the model's default, as in the Python API)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", type=float, help=f"0 = greedy ({MODEL_DEFAULT}, else greedy)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, help="nucleus mass (1 = off)")
    g.add_argument("--min-p", type=float, help="drop tokens below min_p * max prob (0 = off)")
    g.add_argument("--repetition-penalty", type=float, help="divide seen tokens' logits (1 = off)")
    g.add_argument("--presence-penalty", type=float, help="subtract once from every seen token's logit (0 = off)")
    g.add_argument("--frequency-penalty", type=float, help="subtract per occurrence of every seen token (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    g.add_argument("--stop", action="extend", nargs="+", default=[], metavar="S", help="stop strings")
    g.add_argument("--stop-token-ids", action="extend", nargs="+", type=int, default=[], metavar="ID",
                   help="token ids that end the text (besides the model's eos ids)")
    add_constraint(p)
    add_speculative(p)
    p.add_argument("--backend", choices=("auto", "ort", "trt"), default="auto", help="execution backend")
    add_placement(p)
    p.add_argument("--full-verify", dest="verify", action="store_const", const="full", default="fast",
                   help="check the whole sha256 of every artifact file (default: size + first/last MiB)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--no-stats", dest="stats", action="store_false", help="no metrics line on stderr")


def add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="auto", metavar="auto|measure|off|PHASE=BACKEND,...",
                   help="which backend runs each phase on ONNX Runtime: auto (the fastest measured on this machine, "
                        "cached beside the artifact), measure (again), off (ONNX Runtime's CPU provider for both), or "
                        "e.g. prefill=openvino,decode=ort (docs/features/placement.md)")


def add_constraint(p: argparse.ArgumentParser) -> None:
    """--json-schema FILE | --regex R | --grammar FILE (structured output, docs/STRUCTURED.md)."""
    g = p.add_argument_group("structured output (docs/STRUCTURED.md)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", type=Path, metavar="FILE", help="the output is JSON valid under this JSON schema")
    g.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    g.add_argument("--grammar", type=Path, metavar="FILE", help="the output follows this Lark grammar (llguidance syntax)")


SPECULATIVE_HELP = ("ngram: prompt lookup (drafts from n-grams of the prompt and the answer); draft: a draft model "
                    "(--draft); assistant: a draft head that reads the target's hidden states (--draft HEAD); mtp: a Qwen3.5 "
                    "MTP head (--draft HEAD); eagle3: an EAGLE-3 head (--draft HEAD); "
                    "auto: the head or draft model given, else ngram")


def add_speculative(p: argparse.ArgumentParser, help: str = SPECULATIVE_HELP) -> None:
    """--speculative ngram|draft, --draft ARTIFACT, --draft-len K (docs: runtime/speculation/speculative.py); the
    same flags on run, generate, chat, serve and bench (``help``: what --speculative does there)."""
    from decodert.artifact.heads import HEAD_METHOD_NAMES

    g = p.add_argument_group("speculative decoding (the same output, several tokens per model pass)")
    g.add_argument("--speculative", choices=("ngram", "draft", *HEAD_METHOD_NAMES, "auto"), default=None, help=help)
    g.add_argument("--draft", type=Path, default=None, metavar="ARTIFACT",
                   help="the draft model's artifact (same tokenizer), or a draft head's (head.json: `decodert export "
                        "HEAD --target-artifact`); implies --speculative draft, or the head's: assistant | mtp | eagle3")
    g.add_argument("--draft-len", type=int, default=None, metavar="K",
                   help="most tokens drafted per step (default 8; the adaptive width stays at or under it)")


def speculative_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """{"speculative": SpeculativeConfig} | {} from the flags; one-line errors for bad combinations."""
    from decodert.artifact.heads import HEAD_METHOD_NAMES

    method = getattr(args, "speculative", None)
    draft, draft_len = getattr(args, "draft", None), getattr(args, "draft_len", None)
    if method is None and draft is not None:
        from decodert.artifact.heads import head_method

        method = head_method(draft) or "draft"
    if method is None:
        if draft_len is not None:
            raise DecodertError("--draft-len needs --speculative ngram|draft")
        return {}
    if method == "draft" and draft is None:
        raise DecodertError("--speculative draft needs --draft ARTIFACT (the draft model)")
    if method in HEAD_METHOD_NAMES and draft is None:
        raise DecodertError(f"--speculative {method} needs --draft HEAD (a draft head artifact)")
    if method in ("draft", *HEAD_METHOD_NAMES) and draft is not None:
        from decodert.artifact.heads import head_method

        want = head_method(draft) or "draft"
        if method != want:
            raise DecodertError(f"--draft {draft} is {'a draft model' if want == 'draft' else 'a draft head'}: use "
                                f"--speculative {want}")
    if draft_len is not None and draft_len < 1:
        raise DecodertError(f"--draft-len must be >= 1 (got {draft_len})")
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    return {"speculative": SpeculativeConfig(method=method, **({"draft_len": draft_len} if draft_len else {}))}


def draft_of(args: argparse.Namespace) -> Path | None:
    """The --draft artifact to load, after checking the speculative and structured-output flags:
    a bad flag or file fails here, before the model loads (seconds), not after."""
    speculative_kwargs(args)
    check_constraint(args)
    return getattr(args, "draft", None)


def check_constraint(args: argparse.Namespace) -> None:
    """Read --json-schema / --grammar and check them and --regex (a one-line error naming the flag)."""
    kw = constraint_kwargs(args)
    if not kw:
        return
    from decodert.runtime.constraints import Constraint, check_text

    name, value = next(iter(kw.items()))
    flag = "--" + name.replace("_", "-")
    if not value.strip():
        raise DecodertError(f"{flag} {getattr(args, name)} is empty" if name != "regex" else "--regex is empty")
    try:
        check_text(Constraint.of(**kw))  # the model's tokenizer is not needed to parse it
    except MissingDependencyError:
        raise
    except DecodertError as e:
        raise DecodertError(f"{flag}: {e}") from None


def constraint_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """{"json_schema": text} | {"regex": R} | {"grammar": text} | {} from the flags (files read once, here)."""
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    cached = getattr(args, "constraint_text", None)
    if cached is not None:  # a file read before loading (--json-schema /dev/stdin is read once)
        return dict(cached)
    for flag, name in (("--json-schema", "json_schema"), ("--grammar", "grammar")):
        path = getattr(args, name, None)
        if path is not None:
            try:
                args.constraint_text = {name: path.read_text(encoding="utf-8")}
            except (OSError, UnicodeDecodeError) as e:
                raise DecodertError(f"cannot read {flag} {path}: {getattr(e, 'strerror', None) or e}") from None
            return dict(args.constraint_text)
    return {}


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The generation keyword arguments of ``LLM.generate`` from parsed CLI arguments."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}
    if args.greedy:
        given["temperature"] = 0.0
    return {"max_new_tokens": args.max_new_tokens, **given, "seed": args.seed, "stop": list(args.stop),
            "stop_token_ids": list(getattr(args, "stop_token_ids", [])), **constraint_kwargs(args),
            **speculative_kwargs(args)}


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


MODEL_HELP = ("an artifact folder written by `decodert export`, or what `decodert run` takes: 'smollm2', a .gguf file or an "
              "HF folder, exported once into the cache (`decodert cache list`)")


def artifact_of(model: str | Path) -> Path:
    """What ``decodert run`` takes -> an artifact folder: a checkpoint (the name 'smollm2', a .gguf
    file, an HF folder) is exported once into the cache (export/prepare.py, as ``run`` does); any
    other path is returned as it is, for the loader to check (its errors name what is wrong)."""
    from decodert.export.prepare import is_checkpoint_source, prepare_model

    return prepare_model(model) if is_checkpoint_source(model) else Path(model)


def artifact_only(model: str | Path, command: str) -> Path:
    """For build and verify, which need a --target trt export: a checkpoint is refused with the command to run."""
    from decodert.export.prepare import is_checkpoint_source

    if is_checkpoint_source(model):
        raise DecodertError(f"`decodert {command}` needs an artifact exported with --target trt, and {model} is a "
                            f"checkpoint (the cache's exports of `decodert run` are --target ort): `decodert export "
                            f"{model} -o OUT --target trt`, then `decodert {command} OUT`")
    return Path(model)


def load(path: Path, backend: str, verify: str = "fast", draft: Path | None = None, placement: str = "auto"):
    """``decodert.LLM.load`` (api.py; imported here so that ``decodert --help`` never loads onnxruntime) of
    ``path`` and ``draft``: an artifact folder, or a model name or checkpoint exported once into the cache.

    When ``--backend auto`` falls back to ONNX Runtime for an artifact with TensorRT engines, a
    line on stderr says so (and why), so the backend that ran is never a guess."""
    from decodert.api import LLM

    llm = LLM.load(path, backend=backend, verify=verify, draft=draft, placement=placement)
    if backend == "auto" and llm.manifest is not None and llm.manifest.engines and getattr(llm.backend, "name", None) == "ort":
        print("decodert: running on ONNX Runtime (CPU), not the TensorRT engines: no usable NVIDIA GPU / TensorRT "
              "here (--backend trt says why)", file=sys.stderr)
    return llm


def print_stream(stream, out: TextIO) -> None:
    for delta in stream:
        out.write(delta)
        out.flush()


def print_stats(args: argparse.Namespace, stream) -> None:
    if args.stats and stream.result is not None:
        print(stream.result.metrics.summary() + ended_by(stream.result, args.max_new_tokens), file=sys.stderr)


def ended_by(result, max_new_tokens: int) -> str:
    """' | ended by ...' for a text cut short ("length"): the --max-new-tokens limit, or the full cache."""
    if result.finish_reason != "length":
        return ""
    if len(result.token_ids) >= max_new_tokens:
        return f" | ended by --max-new-tokens {max_new_tokens}"
    return " | ended by the full cache (--max-seq tokens of prompt + answer); a larger --max-seq holds more"
