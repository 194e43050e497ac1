"""The fuzz harness's worker process (tests/helpers/fuzz_harness.py starts it).

Reads one JSON line per case, ``{"target": name, "path": damaged sample}``, runs the target and
answers ``{"status": "ok" | "error" | "bug", "message": ...}``. Runs under ``RLIMIT_AS`` =
$FUZZ_MEM_LIMIT bytes; the protocol uses the original stdout, everything else printed goes to stderr.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_samples import ENGINE_TRT  # noqa: E402


def _generate(path: Path, verify: str) -> None:
    from decodert.runtime.llm import LLM

    with LLM.load(path, backend="ort", verify=verify) as llm:
        llm.generate([5, 6, 7], max_new_tokens=2)
        llm.generate("hello", max_new_tokens=2)


def _checkpoint(path: Path) -> None:
    from decodert.export.checkpoints.checkpoint_open import open_checkpoint

    with open_checkpoint(path) as ckpt:
        for name in ckpt.names():
            ckpt.tensor(name)
        ckpt.write_tokenizer(path.parent / "tokenizer-out")


def _manifest(path: Path) -> None:
    from decodert.export.artifact.inspect import inspect_artifact

    inspect_artifact(path)
    _generate(path, "fast")


def _onnx(path: Path) -> None:
    from decodert.export.artifact.inspect import graph_summary

    graph_summary(path / "prefill.onnx")
    _generate(path, "none")


def _engine(path: Path) -> None:
    from decodert.artifact.manifest import load_manifest
    from decodert.plugins.trt.compat import TrtInfo, parse_version, read_engine

    flags = dict.fromkeys(("can_build", "has_kv_cache_update_layer", "has_rotary_layer", "has_attention_layer",
                           "weakly_typed_allowed", "has_timing_cache", "has_runtime_cache", "has_engine_validity",
                           "has_aliased_io", "has_version_compatible", "has_compute_capability"), False)
    info = TrtInfo(ENGINE_TRT["flavour"], ENGINE_TRT["module"], parse_version(ENGINE_TRT["version"]), **flags)
    manifest = load_manifest(path, verify="fast")
    for name in ("prefill", "decode"):
        read_engine(path, manifest, name, info)


def _template(path: Path) -> None:
    """Render a chat template from a model file (bytes that are not UTF-8 replaced, as a reader would)."""
    from decodert.runtime.chat.chat import render_chat
    from decodert.runtime.chat.template_sandbox import Limits

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " * 50}]
    render_chat(path.read_bytes().decode("utf-8", "replace"), messages, bos_token="<s>", eos_token="</s>",
                limits=Limits(seconds=0.5))  # shorter than the default 2 s: many cases per second


def _selftest(path: Path) -> None:
    """Failures the harness must notice (tests/project/test_fuzz.py): path.name says which."""
    import numpy as np

    if path.name == "crash":
        os.abort()
    if path.name == "hang":
        while True:
            pass
    if path.name == "memory":
        np.ones(1 << 40, np.uint8)  # 1 TiB: MemoryError under the address-space limit
    raise ValueError("not a DecodertError")


TARGETS = {"gguf": _checkpoint, "safetensors": _checkpoint, "manifest": _manifest, "onnx": _onnx,
           "weights": lambda p: _generate(p, "none"), "engine": _engine, "template": _template, "selftest": _selftest}


def run_case(target: str, path: Path) -> dict:
    from decodert.errors import DecodertError

    try:
        TARGETS[target](path)
    except DecodertError as e:
        text = str(e)
        return {"status": "error" if "\n" not in text and text else "bug", "message": f"DecodertError: {text}"}
    except BaseException:  # noqa: BLE001 - MemoryError, RecursionError, anything: all are findings
        return {"status": "bug", "message": traceback.format_exc()[-2000:]}
    return {"status": "ok", "message": ""}


def main() -> None:
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # prints of the code under test (tqdm, onnxruntime) go to the log, not the protocol
    limit = int(os.environ.get("FUZZ_MEM_LIMIT", "0"))
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for line in sys.stdin:
        request = json.loads(line)
        channel.write(json.dumps(run_case(request["target"], Path(request["path"]))) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
