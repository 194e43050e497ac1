"""Fuzz harness for tests/project/test_fuzz.py (bounded) and scripts/fuzz.py (long runs).

A case damages one file of a pristine sample (tests/helpers/fuzz_samples.py) with a mutator and runs a
*target* (the loader a user would hit) on the copy, in a ``Worker`` subprocess:
- a segfault/abort of a native reader (onnxruntime, the gguf reader's numpy views) is reported as
  "crash" instead of killing pytest;
- every case has a time limit: a hang is reported as "hang";
- the worker runs under an address-space limit, so allocating from a huge declared size fails
  fast with MemoryError, which is reported as "bug" like any exception but DecodertError.
Acceptable outcomes are "ok" (the damage was harmless, e.g. a flipped weight bit) and "error"
(a DecodertError with a one-line message).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

HERE = Path(__file__).resolve().parent
GOOD = ("ok", "error")
INTS = (0, 1, 2, 7, 255, 256, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1)
JSON_VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 1, 2**31, 2**64, -(2**63), 1e308, float("nan"), 0.5, "",
                                "x", "../secret", "/etc/passwd", [], [1, 2], {}, {"a": 1}, "\u0000")


class Chooser(Protocol):
    """Where mutators get their choices from (hypothesis ``data`` or a seeded ``random.Random``)."""

    def integer(self, lo: int, hi: int) -> int: ...


def choose(c: Chooser, items: Sequence[Any]) -> Any:
    return items[c.integer(0, len(items) - 1)]


# ---------------------------------------------------------------- mutators: (bytes, chooser) -> bytes
def truncate(data: bytes, c: Chooser) -> bytes:
    return data[: c.integer(0, max(len(data) - 1, 0))]


def flip_bits(data: bytes, c: Chooser) -> bytes:
    buf = bytearray(data)
    for _ in range(c.integer(1, 8)):
        i = c.integer(0, len(buf) - 1)
        buf[i] ^= 1 << c.integer(0, 7)
    return bytes(buf)


def overwrite_int(data: bytes, c: Chooser) -> bytes:
    """An interesting u32/u64 (0, 2**31, 2**64-1, ...) written at a random place."""
    code = choose(c, ("<I", "<Q"))
    value = choose(c, INTS) % (1 << (8 * struct.calcsize(code)))
    i = c.integer(0, max(len(data) - struct.calcsize(code), 0))
    return data[:i] + struct.pack(code, value) + data[i + struct.calcsize(code):]


def extend(data: bytes, c: Chooser) -> bytes:
    return data + bytes(c.integer(1, 4096))


def gguf_field(data: bytes, c: Chooser) -> bytes:
    """An interesting value in one header number (a count, string length, type id, dim or offset)."""
    from decodert.export.checkpoints.gguf_header import walk_gguf

    fields = walk_gguf(data, len(data), record=True).fields or []
    offset, code, _ = choose(c, fields)
    value = choose(c, INTS) % (1 << (8 * struct.calcsize(code)))
    packed = struct.pack("<Q", value)[: struct.calcsize(code)]
    return data[:offset] + packed + data[offset + len(packed):]


def _json_paths(node: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out += _json_paths(value, path + (key,))
    return out


def mutate_json_tree(doc: Any, c: Chooser) -> Any:
    """Replace a random node with an odd value, delete it, or wrap it in 100k lists."""
    paths = [p for p in _json_paths(doc) if p]
    if not paths:
        return choose(c, JSON_VALUES)
    path = choose(c, paths)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    action = c.integer(0, 9)
    if action == 0 and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == 1:
        parent[path[-1]] = _DEEP
    else:
        parent[path[-1]] = choose(c, JSON_VALUES)
    return doc


_DEEP = "__deeply_nested__"  # serialised as 100k nested lists (json.dumps itself would recurse)


def dump_json(doc: Any) -> bytes:
    return json.dumps(doc).replace(f'"{_DEEP}"', "[" * 100_000 + "]" * 100_000).encode()


def json_tree(data: bytes, c: Chooser) -> bytes:
    return dump_json(mutate_json_tree(json.loads(data), c))


def safetensors_header(data: bytes, c: Chooser) -> bytes:
    """Mutate the JSON header; keep its length prefix right (or not, 1 in 4)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = dump_json(mutate_json_tree(json.loads(data[8:8 + n]), c))
    prefix = len(header) if c.integer(0, 3) else choose(c, INTS)
    return struct.pack("<Q", prefix) + header + data[8 + n:]


def onnx_external(data: bytes, c: Chooser) -> bytes:
    """Point one initializer's external data somewhere odd (../secret, huge offset, garbage length)."""
    import onnx

    model = onnx.load_from_string(data)
    tensors = [t for t in model.graph.initializer if t.external_data]
    entry = choose(c, list(choose(c, tensors).external_data))
    entry.value = choose(c, ("../secret", "/etc/passwd", "", "weights.bin\0x", "-1", "abc", str(2**70), "0",
                             "decode.onnx", "../art/weights.bin"))
    return model.SerializeToString()


# Chat-template pieces: time, memory and output-size bombs, sandbox escapes, plain template code.
_N = ("0", "1", "7", "1000", "100000", "100001", "10**6", "2**31", "4000000000", "-1", "messages|length")
_PIECES = (
    "{{ 'a' * N }}", "{{ ['ab'] * N }}", "{{ lipsum(N) }}", "{{ range(N)|list|length }}", "{{ range(N)|join('xy') }}",
    "{% set ns.x = ns.x ~ ns.x %}", "{% set ns.x = ns.x + ns.x %}", "{{ ns.x|length }}", "{{ N ** N }}",
    "{{ '%Nd' % 1 }}", "{{ '{:>N}'.format(1) }}", "{{ 'x'|center(N) }}", "{{ 'x'.ljust(N) }}", "{{ '%s'|format(N) }}",
    "{{ 'x'|indent(N) }}", "{{ 'ab'|wordwrap(N) }}", "{{ messages|tojson }}", "{{ messages[0]['content'] * N }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{ raise_exception('no') }}", "{{ undefined_name.x }}",
    "{{ cycler.__init__.__globals__ }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ ''|attr('__class__') }}",
    "{{ joiner.__init__.__globals__['os'] }}", "{{ namespace.__init__.__globals__ }}", "{{ (1).__class__ }}",
    "{{ self.__init__.__globals__ }}", "{{ config }}", "{{ request }}", "{{ strftime_now('%Y') }}",
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}", "{{ bos_token }}{{ eos_token }}",
    "{% if add_generation_prompt %}<|assistant|>{% endif %}", "{{ dict(a=N) }}", "{{ 1/0 }}", "{{ 'é' * 3 }}",
    "{% for i in range(N) %}{% for j in range(N) %}{{ i }}{% endfor %}{% endfor %}", "{% raw %}{{ x }}{% endraw %}",
)


def template_bomb(data: bytes, c: Chooser) -> bytes:
    """A chat template made of 1-6 pieces (bombs, escapes, normal code), some inside loops."""
    parts = ["{% set ns = namespace(x='ab') %}"]
    for _ in range(c.integer(1, 6)):
        piece = choose(c, _PIECES).replace("N", choose(c, _N))
        for _ in range(c.integer(0, 2)):  # nested loops around it
            piece = "{% for _ in range(" + choose(c, _N) + ") %}" + piece + "{% endfor %}"
        parts.append(piece)
    return "".join(parts).encode()


def template_splice(data: bytes, c: Chooser) -> bytes:
    """A piece spliced into the sample's template at a random place (may break its syntax)."""
    i = c.integer(0, len(data))
    return data[:i] + choose(c, _PIECES).replace("N", choose(c, _N)).encode() + data[i:]


MUTATORS: dict[str, Callable[[bytes, Chooser], bytes]] = {
    "truncate": truncate, "flip": flip_bits, "int": overwrite_int, "extend": extend, "gguf-field": gguf_field,
    "json": json_tree, "st-header": safetensors_header, "onnx-extdata": onnx_external,
    "template-bomb": template_bomb, "template-splice": template_splice}

# target -> sample, the files it damages and with which mutators
PLANS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "gguf": ("gguf", {"mini.gguf": ("truncate", "flip", "int", "gguf-field", "gguf-field", "gguf-field")}),
    "safetensors": ("hf", {"model.safetensors": ("truncate", "flip", "int", "st-header", "st-header"),
                           "config.json": ("json",)}),
    "manifest": ("art", {"manifest.json": ("json", "json", "json", "truncate", "flip")}),
    "onnx": ("art", {"prefill.onnx": ("truncate", "flip", "int", "onnx-extdata", "onnx-extdata")}),
    "weights": ("art", {"weights.bin": ("truncate", "extend", "flip")}),
    "engine": ("eng", {"prefill.engine": ("truncate", "flip", "extend"), "manifest.json": ("json",)}),
    "template": ("template", {"chat_template.jinja": ("template-bomb", "template-bomb", "template-splice", "flip")}),
}


@dataclass
class Outcome:
    status: str  # ok | error | bug | crash | hang
    message: str = ""
    case: str = ""

    def report(self) -> str:
        return f"{self.status} in case {self.case}: {self.message}"


class Fuzzer:
    """Damage a copy of a sample, run the target on it in the worker, return the Outcome."""

    def __init__(self, samples: dict[str, Path], workdir: Path, timeout: float = 60.0) -> None:
        self.samples, self.workdir, self.timeout = samples, workdir, timeout
        self.worker = Worker()
        self.n = 0

    def case(self, target: str, c: Chooser) -> Outcome:
        sample, files = PLANS[target]
        name = choose(c, list(files))
        mutator = choose(c, files[name])
        src = self.samples[sample]
        dst = self.workdir / f"case{self.n}" / src.name
        self.n += 1
        shutil.rmtree(dst.parent, ignore_errors=True)
        if src.is_dir():
            shutil.copytree(src, dst)
            damaged = dst / name
        else:
            dst.parent.mkdir(parents=True)
            damaged = dst
        damaged.write_bytes(MUTATORS[mutator]((src / name if src.is_dir() else src).read_bytes(), c))
        out = self.worker.run(target, dst, self.timeout)
        out.case = f"{target}/{name}/{mutator} ({damaged})"
        if out.status in GOOD:
            shutil.rmtree(dst.parent, ignore_errors=True)
        return out

    def run_bytes(self, target: str, name: str, data: bytes) -> Outcome:
        """The target on its sample with file ``name`` replaced by ``data`` (regression cases)."""
        sample = self.samples[PLANS[target][0]]
        dst = self.workdir / f"case{self.n}" / sample.name
        self.n += 1
        if sample.is_dir():
            shutil.copytree(sample, dst)
            (dst / name).write_bytes(data)
        else:
            dst.parent.mkdir(parents=True)
            dst.write_bytes(data)
        out = self.worker.run(target, dst, self.timeout)
        out.case = f"{target}/{name} ({dst})"
        return out

    def close(self) -> None:
        self.worker.close()


class Worker:
    """A subprocess running targets (tests/helpers/fuzz_worker.py); restarted after a crash or a hang."""

    def __init__(self, mem_limit_gb: float = 6.0) -> None:
        self.mem_limit = int(mem_limit_gb * 2**30)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fuzz-worker-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "FUZZ_MEM_LIMIT": str(self.mem_limit), "DECODERT_THREADS": "1"}
        cmd = [sys.executable, str(HERE / "fuzz_worker.py")]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)

    def run(self, target: str, path: Path, timeout: float) -> Outcome:
        self.proc = self.proc if self.proc and self.proc.poll() is None else self._start()
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write((json.dumps({"target": target, "path": str(path)}) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if line:
            return Outcome(**json.loads(line))
        if not ready:
            self.close()
            return Outcome("hang", f"no answer within {timeout:.0f} s")
        code = self.proc.wait()
        self.proc = None
        return Outcome("crash", f"worker died with exit code {code}; log: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-800:]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def gguf_field(data: bytes, *edits: tuple[str, int]) -> bytes:
    """Header numbers (named as walk_gguf records them) set to new values."""
    from decodert.export.checkpoints.gguf_header import walk_gguf

    fields = {what: (offset, code) for offset, code, what in walk_gguf(data, len(data), record=True).fields}
    for what, value in edits:
        offset, code = fields[what]
        data = data[:offset] + struct.pack("<" + code, value) + data[offset + struct.calcsize(code):]
    return data
