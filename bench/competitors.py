"""The other runtimes of bench/compare.py: each converts the checkpoint with its own tools and runs
one greedy request with the same timing contract as decodert's ``BackendRunner``:

    runner.run(ids [L] int64, gen) -> RunTiming(prefill_s, step_s [gen - 1])

prefill_s covers the prompt up to the first generated token; each of the ``gen - 1`` steps after
it runs the model on one new token per row. EOS never ends a run early.

- onnxruntime-genai: ``python -m onnxruntime_genai.models.builder`` from an HF folder that
  transformers writes from the GGUF (the builder reads HF folders; its GGUF input needs a float
  GGUF plus a hub config).
- llama.cpp (llama-cpp-python): the Q4_1 GGUF as is, and an F32 GGUF written here with the
  ``gguf`` package (every tensor dequantized, metadata copied, file type set to all-F32).
- OpenVINO GenAI: ``optimum-cli export openvino`` from the same HF folder (int4: asymmetric, group
  32, ``--ratio 1.0`` so every linear layer is 4-bit; fp32: ``--weight-format fp32``), run by
  bench/ovgenai_worker.py with the interpreter of the environment it is installed in (``--ov-venv``,
  bench/install.py): decodert never imports openvino_genai.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from decodert.tools.bench import RunTiming

GGUF_ALL_F32 = 0  # general.file_type values: an all-F32 file
GGUF_MOSTLY_Q4_0 = 2  # and a mostly-Q4_0 one


# ---- conversions -------------------------------------------------------------------------------
def make_hf_folder(gguf_path: Path, folder: Path) -> Path:
    """transformers' float32 view of the GGUF, saved as an HF folder (config, safetensors, tokenizer)."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype="float32")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained; a plain copy does not
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(loaded.state_dict())
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def build_ortgenai(hf_folder: Path, out: Path, precision: str, threads: int, block_size: int = 32,
                   timeout_s: int = 1800, python: str = sys.executable) -> Path:
    """Run onnxruntime-genai's model builder (CPU, ``precision`` fp32 | int4 at ``block_size``, its
    CPU default accuracy level 4) with the interpreter ``python``, pin its thread count."""
    if not (out / "genai_config.json").is_file():
        cmd = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(out.parent / "ortgenai_cache")]
        if precision == "int4":
            cmd += ["--extra_options", f"int4_block_size={block_size}", "int4_accuracy_level=4"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not (out / "genai_config.json").is_file():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"model builder failed ({precision}): {' | '.join(tail)}")
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    session = config["model"]["decoder"].setdefault("session_options", {})
    session["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))
    return out


def build_ovgenai(hf_folder: Path, out: Path, precision: str, python: Path, block_size: int = 32,
                  timeout_s: int = 3600) -> Path:
    """optimum-intel's OpenVINO export of ``hf_folder`` (``precision`` fp32 | int4: asymmetric, group
    ``block_size``, ratio 1.0) with the ``optimum-cli`` beside the interpreter ``python``."""
    if not (out / "openvino_model.xml").is_file():
        cmd = [str(python.parent / "optimum-cli"), "export", "openvino", "-m", str(hf_folder),
               "--task", "text-generation-with-past", "--weight-format", precision]
        if precision == "int4":
            cmd += ["--group-size", str(block_size), "--ratio", "1.0"]
        proc = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not (out / "openvino_model.xml").is_file():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"optimum-cli export openvino failed ({precision}): {' | '.join(tail)}")
    return out


OVGENAI_WORKER = Path(__file__).parent / "ovgenai_worker.py"


def run_ovgenai(python: Path, folder: Path, ids: np.ndarray, gen: int, threads: int, warmup: int = 1,
                warmup_ids: np.ndarray | None = None, timeout_s: float = 1800) -> RunTiming:
    """One OpenVINO GenAI request in a fresh worker process under ``python`` (bench/ovgenai_worker.py):
    ``warmup`` untimed requests on ``warmup_ids`` (other ids: no prefix-cache hit), then ``ids`` timed."""
    warm = warmup_ids if warmup_ids is not None else (ids[::-1] + 1)
    job = {"folder": str(folder), "threads": threads, "ids": ids.tolist(), "warmup_ids": warm.tolist(),
           "gen": gen, "warmup": warmup}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own environment only
    proc = subprocess.run([str(python), str(OVGENAI_WORKER), json.dumps(job)], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"openvino-genai worker failed: {tail[:300]}")
    out = json.loads(lines[-1])
    return RunTiming(out["prefill_s"], np.asarray(out["step_s"]))


def make_f32_gguf(src: Path, dst: Path) -> Path:
    """Copy of ``src`` with every tensor dequantized to F32 (llama.cpp runs it like an F32 conversion)."""
    return _rewrite_gguf(src, dst, GGUF_ALL_F32, lambda t: None)


def make_q4_0_gguf(src: Path, dst: Path) -> Path:
    """Copy of ``src`` with the Q4_1 matrices requantized to Q4_0 (the Q8_0 embedding and F32 norms
    copied as they are): llama.cpp runs it as is, and decodert transcodes every block of it exactly
    (``--quant int4 --keep-q8``), so both runtimes compute with bit-identical weights."""
    import gguf

    def q4_0(t: Any) -> tuple[np.ndarray, Any]:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            return np.asarray(t.data), t.tensor_type  # raw bytes as stored
        q4 = gguf.GGMLQuantizationType.Q4_0
        return gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), q4), q4

    return _rewrite_gguf(src, dst, GGUF_MOSTLY_Q4_0, q4_0)


def _rewrite_gguf(src: Path, dst: Path, file_type: int, convert: Callable[[Any], tuple[np.ndarray, Any] | None]) -> Path:
    """``src`` with its metadata and each tensor either ``convert(t)`` = (raw GGUF bytes, their
    quantization type) or, where that is None, dequantized to F32."""
    if dst.is_file():
        return dst
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)  # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(file_type)
    for t in reader.tensors:
        raw = convert(t)
        if raw is None:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
        else:
            writer.add_tensor(t.name, raw[0], raw_shape=raw[0].shape, raw_dtype=raw[1])
    return finish_gguf(writer, tmp, dst)


def finish_gguf(writer: Any, tmp: Path, dst: Path) -> Path:
    """Write a ``gguf.GGUFWriter`` filled at ``tmp`` (header, metadata, tensors) and move it to ``dst``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


# ---- runners -----------------------------------------------------------------------------------
class OrtGenaiRunner:
    """onnxruntime-genai Generator, greedy; min_length = max_length keeps EOS from ending a run."""

    def __init__(self, folder: Path, batch: int) -> None:
        import onnxruntime_genai as og

        self.og, self.batch = og, batch
        self.model = og.Model(str(folder))

    def run(self, ids: np.ndarray, gen: int) -> RunTiming:
        og, total = self.og, len(ids) + gen
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=self.batch)
        generator = og.Generator(self.model, params)
        clock = time.perf_counter
        t0 = clock()
        generator.append_tokens(np.tile(ids.astype(np.int32), (self.batch, 1)))
        generator.generate_next_token()  # picks the first token from the prompt's logits
        prefill_s = clock() - t0
        steps = np.empty(gen - 1)
        for i in range(gen - 1):
            t0 = clock()
            generator.generate_next_token()  # runs the model on the previous token, picks the next
            steps[i] = clock() - t0
        del generator
        return RunTiming(prefill_s, steps)


class LlamaCppRunner:
    """llama-cpp-python's ``Llama.eval`` (llama_decode) with greedy argmax of the last logits; batch 1."""

    def __init__(self, gguf_path: Path, n_ctx: int, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def run(self, ids: np.ndarray, gen: int) -> RunTiming:
        llm, clock = self.llm, time.perf_counter
        llm.reset()
        t0 = clock()
        llm.eval([int(t) for t in ids])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        prefill_s = clock() - t0
        steps = np.empty(gen - 1)
        for i in range(gen - 1):
            t0 = clock()
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            steps[i] = clock() - t0
        return RunTiming(prefill_s, steps)

    def close(self) -> None:
        self.llm.close()
