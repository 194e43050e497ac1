"""OpenVINO's own runtime running the ort target's prefill graph (``openvino.Core().read_model``), one row a call.

OpenVINO reads the ort target's com.microsoft ops (MatMulNBits -> a compressed FullyConnected, GroupQueryAttention
-> its own attention op) where its ONNX Runtime execution provider refuses them, and prefills them several times
faster than MLAS on an AMX / AVX-512 VNNI CPU. Its attention does not write a shared cache in place: it appends the
new K/V to the past it is given (present [1, H, past + n, D]). So a call feeds the rows the slot holds so far
(``past_*`` reshaped to [1, H_kv, ?, D]: nothing for a fresh prompt, a copy of the held rows otherwise) and copies
only the n new rows of ``present_*`` into the cache buffers; the decode step (MLAS) then reads them in place.
(Found by the "peers" helper of issue 47, bench/ov_prefill.py.) A whole prompt runs in one call: OpenVINO's
attention has no cost over the square that made the ort backend cut long prompts into 512-token chunks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError, first_line


def available() -> bool:
    """Is OpenVINO's Python runtime installed (the ``openvino`` package)?"""
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


def properties(threads: int | None, exact: bool = False) -> dict[str, Any]:
    """The CPU plugin's properties: ``$DECODERT_OPENVINO_CONFIG`` (a JSON object) over the defaults: the thread
    count, and with ``exact`` (a float-weight artifact) ``INFERENCE_PRECISION_HINT`` f32, so that the prefill
    gives the tokens the ort backend gives (OpenVINO's own default on an AMX / AVX-512 BF16 CPU is bf16, which
    changed SmolLM2 fp32's greedy chat answer); a quantized artifact keeps OpenVINO's default."""
    props: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"} if exact else {}
    text = os.environ.get("DECODERT_OPENVINO_CONFIG", "")
    if text:
        try:
            props = {**props, **dict(json.loads(text))}
        except (ValueError, TypeError):
            raise DecodertError(f"DECODERT_OPENVINO_CONFIG must be a JSON object of OpenVINO CPU properties, got {text!r}") from None
    threads = threads or int(os.environ.get("DECODERT_THREADS", "0")) or None
    if threads:
        props.setdefault("INFERENCE_NUM_THREADS", int(threads))
    return props


# prompt lengths the runner is warmed with at load (``warm``): three, none of them round, up to about 512 tokens
WARM_LENGTHS = (40, 200, 520)
LOWERINGS = ("frontend", "sdpa", "paged")  # OpenVINO's own translation; lowering.py's GqaToSdpa, GqaToPaged


class NativePrefill:
    """The prefill graph at ``path`` compiled by OpenVINO with its cache inputs' sequence axis free. ``lowering``:
    "frontend" (OpenVINO's own translation: placement's ``openvino-native``), "sdpa" or "paged" (its
    GroupQueryAttention nodes translated by runtime/backends/openvino/lowering.py: ``openvino-sdpa``, fed the held
    rows; ``openvino-paged``, the held rows written into its blocks)."""

    def __init__(self, path: Path, threads: int | None = None, exact: bool = False, lowering: str = "frontend") -> None:
        import openvino as ov

        from decodert.runtime.backends.openvino import lowering as lower

        self._ov = ov
        if lowering not in LOWERINGS:
            raise DecodertError(f"OpenVINO prefill lowering {lowering!r}: one of {', '.join(LOWERINGS)}")
        props = properties(threads, exact)
        core = ov.Core()
        try:  # what the CPU plugin will run in: the hint given, else its default here (bf16 on an AVX-512 BF16 CPU)
            precision = props.get("INFERENCE_PRECISION_HINT") or core.get_property("CPU", "INFERENCE_PRECISION_HINT")
        except RuntimeError:
            precision = "f32"
        precision = precision.get_type_name() if isinstance(precision, ov.Type) else str(precision).lower()
        half = precision in ("bf16", "f16")
        translator = {"frontend": None, "sdpa": lower.GqaToSdpa, "paged": lower.GqaToPaged}[lowering]
        translator = translator(half=half) if translator else None
        self.paged = lowering == "paged"
        if self.paged:  # the blocks the caller writes the held rows into, in the run's precision (OpenVINO's own is u8)
            props.setdefault("KV_CACHE_PRECISION", precision if half else "f32")
        try:
            if translator is not None:
                for extension in translator.extensions():
                    core.add_extension(extension)
            model = core.read_model(str(path))
            if self.paged:
                translator.finish(model)
            _keep_read(model, self.paged)
            shapes = {}
            for port in model.inputs:
                name = port.get_any_name()
                if name.startswith("past_") and name not in ("past_lengths", "past_lens"):
                    dims = port.get_partial_shape()
                    shapes[name] = ov.PartialShape([-1, dims[1], -1, dims[3]])
            model.reshape(shapes)
            compiled = core.compile_model(model, "CPU", props)
            self.request = compiled.create_infer_request()
        except (RuntimeError, ValueError) as e:  # an op it cannot read, a shape it cannot take
            why = (translator and translator.refused) or openvino_reason(e)
            raise DecodertError(f"{path}: OpenVINO cannot compile the graph ({why[:300]})") from None
        self.names = {p.get_any_name() for p in compiled.inputs}
        self._translator = translator  # its kept codes back constants of the compiled model
        self.zero = np.zeros(1, np.int64)
        self.warmed_s = 0.0  # the seconds ``warm`` took (0: not warmed)
        self.blocks: dict[str, tuple] = {}  # paged: key_cache.i / value_cache.i -> (the cache's key.i / value.i, [H_kv, block, D])
        self._blocks_held: dict[str, Any] = {}  # paged: the ov.Tensor of blocks of each (grown)
        self.block_type = self.block = None
        if self.paged:
            self._check_blocks(path, compiled)

    def _check_blocks(self, path: Path, compiled: Any) -> None:
        """The plugin's block layout of the paged caches: [blocks, H_kv, block, D] in f32 / bf16 / f16 (a layout
        with scales, such as u8, is refused: the caller writes the held rows itself)."""
        ov = self._ov
        for port in compiled.inputs:
            name = port.get_any_name()
            if "_cache." not in name:
                continue
            ps, et = port.get_partial_shape(), port.get_element_type()
            if et not in (ov.Type.f32, ov.Type.bf16, ov.Type.f16) or ps.rank.get_length() != 4 or not all(
                    ps[i].is_static for i in (1, 2, 3)):
                raise DecodertError(f"{path}: OpenVINO's paged cache here is {et} {ps}: not a layout decodert writes")
            self.block_type, self.block = et, ps[2].get_length()
            self.blocks[name] = (name.replace("_cache.", ".", 1), [ps[i].get_length() for i in (1, 2, 3)])

    def warm_rows(self) -> int:
        """The cache rows ``warm`` needs (its longest prompt)."""
        return max(WARM_LENGTHS)

    def warm(self, cache: Any, vocab: int, rows: int = 0) -> float:
        """Run the ``WARM_LENGTHS`` prompts (those that fit ``cache``, a scratch cache of one row) once, so that the
        first request does not pay what OpenVINO's CPU plugin does on the first calls after compile (kernels made
        for new shapes, its buffers grown: measured on SmolLM2 int4, the first 1024-token prompt after a 16-token
        one 458-474 ms without, 393-415 ms with). Paged, the blocks are made for ``rows`` (the artifact's
        max_seq) first and written once: fresh memory costs its page faults at the first write (~1.5 ms a MB on
        this project's VM), which a long prompt would otherwise pay inside its attention. Returns the seconds."""
        start = time.perf_counter()
        if self.paged and rows:
            count = -(-rows // self.block)
            for name, (_, (heads, _, dim)) in self.blocks.items():
                self.blocks_tensor(name, count, heads, dim).data.view(np.uint8).fill(0)
        for n in WARM_LENGTHS:
            if n <= cache.max_seq:
                cache.reset()
                self.run(cache, 0, np.arange(n, dtype=np.int64) % vocab)
        cache.reset()
        self.warmed_s = time.perf_counter() - start
        return self.warmed_s

    def feeds(self, cache: Any, slot: int, ids: np.ndarray) -> dict[str, Any]:
        """Every input of the call that appends ``ids`` [n] to ``slot``: the ids and lengths, and the rows the slot
        holds (``past_*`` [1, H_kv, past, D] copies; paged: written into the blocks, with their tables)."""
        past, n = int(cache.lengths[slot]), len(ids)
        feeds: dict[str, Any] = {"input_ids": np.ascontiguousarray(ids, np.int64).reshape(1, n),
                                 "past_lengths": np.array([past], np.int64), "seq_lengths": np.array([n], np.int64)}
        if "per_position" in self.names:
            feeds["per_position"] = self.zero
        names = _cache_names(cache)
        if self.paged:
            feeds.update(self.paged_feeds(cache, slot, past, n, names))
        else:
            for i, name in enumerate(names):
                feeds[f"past_{name}"] = np.ascontiguousarray(cache.buffers[i][slot : slot + 1, :, :past])
        return {k: v for k, v in feeds.items() if k in self.names}

    def run(self, cache: Any, slot: int, ids: np.ndarray) -> np.ndarray:
        """Append ``ids`` [n] to ``slot``'s K/V (the new rows copied into the cache); returns the logits [V]
        after the last one. The caller commits the ids."""
        ov, req = self._ov, self.request
        past, n = int(cache.lengths[slot]), len(ids)
        for name, arr in self.feeds(cache, slot, ids).items():
            req.set_tensor(name, arr if isinstance(arr, ov.Tensor) else ov.Tensor(arr))
        try:
            req.infer()
        except RuntimeError as e:
            raise DecodertError(f"OpenVINO failed running the prefill graph ({first_line(e)[:300]})") from None
        self.collect(cache, slot, past, n)
        return np.array(req.get_tensor("logits").data[0], np.float32)

    def collect(self, cache: Any, slot: int, past: int, n: int) -> None:
        """After a call: the ``n`` new rows into ``slot``'s cache buffers at ``past`` (from ``present_*``; paged,
        from the blocks its attention wrote them into)."""
        names = _cache_names(cache)
        if not self.paged:
            for i, name in enumerate(names):
                cache.buffers[i][slot, :, past : past + n] = self.request.get_tensor(f"present_{name}").data[0, :, past : past + n]
            return
        by_name = dict(zip(names, cache.buffers))
        for cache_name, (rows_name, _) in self.blocks.items():
            _read_blocks(self._blocks_held[cache_name], by_name[rows_name][slot], past, n, self.block,
                         self.block_type == self._ov.Type.bf16)

    def paged_feeds(self, cache: Any, slot: int, past: int, n: int, names: list[str]) -> dict[str, Any]:
        """The block tables of one sequence of ``past + n`` rows in blocks 0.., and the held rows written into
        the blocks (in the plugin's cache type)."""
        ov, block = self._ov, self.block
        count = -(-(past + n) // block)
        feeds: dict[str, Any] = {
            "past_lens": np.array([past], np.int32), "subsequence_begins": np.array([0, n], np.int32),
            "block_indices": np.arange(count, dtype=np.int32), "block_indices_begins": np.array([0, count], np.int32),
            "max_context_len": np.array(past + n, np.int32)}
        by_name = dict(zip(names, cache.buffers))
        for cache_name, (rows_name, (heads, _, dim)) in self.blocks.items():
            tensor = self.blocks_tensor(cache_name, count, heads, dim)
            if past:
                _write_blocks(tensor, by_name[rows_name][slot, :, :past], block, self.block_type == ov.Type.bf16)
            feeds[cache_name] = tensor
        return feeds

    def blocks_held(self) -> dict[str, Any]:
        """Paged: each cache input's ov.Tensor of blocks as made so far."""
        return dict(self._blocks_held)

    def blocks_tensor(self, name: str, count: int, heads: int, dim: int) -> Any:
        """``name``'s blocks, at least ``count`` of them (grown by doubling; the content is rewritten every call)."""
        tensor = self._blocks_held.get(name)
        if tensor is None or tensor.shape[0] < count:
            size = max(count, 2 * (tensor.shape[0] if tensor is not None else 0), 8)
            tensor = self._blocks_held[name] = self._ov.Tensor(self.block_type, [size, heads, self.block, dim])
        return tensor


def openvino_reason(error: BaseException) -> str:
    """The line of an OpenVINO error that says what failed: its frontend's summary (the ops with no conversion
    rule first: what is missing, not what failed after it), else the first line that is not a source location."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    summary = [line[3:] for line in lines if line.startswith("-- No conversion rule found") or line.startswith("-- Conversion is failed")]
    if summary:
        return "; ".join(summary)
    told = [line for line in lines if not line.startswith(("Exception from ", "Check '")) and " failed at src/" not in line]
    return (told or lines or [type(error).__name__])[0]


UNREAD = ("next_token", "next_tokens", "seq_logits")  # prefill outputs a call never reads (it takes the logits)


def _keep_read(model: Any, paged: bool) -> None:
    """Drop what a call does not read, so that OpenVINO neither computes nor allocates it: ``UNREAD``, and paged
    the ``present_*`` outputs (its new rows are read from the blocks) and the ``past_*`` inputs it does not read."""
    for result in list(model.get_results()):
        names = result.output(0).get_names()
        if names & set(UNREAD) or (paged and any(n.startswith(("present_key.", "present_value.")) for n in names)):
            model.remove_result(result)
    if paged:
        for param in list(model.get_parameters()):
            if param.get_friendly_name().startswith(("past_key.", "past_value.")) and not param.output(0).get_target_inputs():
                model.remove_parameter(param)
    model.validate_nodes_and_infer_types()


def _block_spans(start: int, stop: int, block: int) -> list[tuple[int, int, int]]:
    """Rows [start, stop) as (block, first row in it, rows) runs: a part block, whole blocks, a part block."""
    spans, row = [], start
    while row < stop:
        b, off = divmod(row, block)
        if off == 0 and stop - row >= block:  # whole blocks: one span
            count = (stop - row) // block
            spans.append((b, 0, count * block))
            row += count * block
        else:
            take = min(block - off, stop - row)
            spans.append((b, off, take))
            row += take
    return spans


def _read_blocks(tensor: Any, rows: np.ndarray, past: int, n: int, block: int, bf16: bool) -> None:
    """Rows past .. past + n of blocks [*, H_kv, block, D] (bf16 or f32) into ``rows`` [H_kv, max, D] f32, in place
    (bf16 widened exactly: its bits are the high half of the f32)."""
    data = tensor.data.view(np.uint16) if bf16 else tensor.data
    heads, _, dim = rows.shape
    for b, off, count in _block_spans(past, past + n, block):
        row = b * block + off
        dest = rows[:, row : row + count]
        if off == 0 and count >= block:  # whole blocks [k, H, block, D] -> [H, k block, D]
            src = data[b : b + count // block].transpose(1, 0, 2, 3)
            dest = dest.reshape(heads, count // block, block, dim)  # a view: the row axis split
            if not np.may_share_memory(dest, rows):
                raise DecodertError("the cache rows are not a view of the cache (a copy would lose the new rows)")
        else:
            src = data[b, :, off : off + count]
        if bf16:
            np.left_shift(src, 16, out=dest.view(np.uint32), dtype=np.uint32, casting="unsafe")
        else:
            np.copyto(dest, src)


def _write_blocks(tensor: Any, rows: np.ndarray, block: int, bf16: bool) -> None:
    """rows [H_kv, P, D] (f32) into blocks [*, H_kv, block, D]: row t in block t // block at t % block."""
    heads, past, dim = rows.shape
    data = tensor.data
    if bf16:  # numpy has no bfloat16: round the f32 bits to nearest-even and keep the high half
        bits = np.ascontiguousarray(rows, np.float32).view(np.uint32)
        rows = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        data = data.view(np.uint16)
    full, rest = divmod(past, block)
    if full:
        data[:full] = rows[:, : full * block].reshape(heads, full, block, dim).transpose(1, 0, 2, 3)
    if rest:
        data[full, :, :rest] = rows[:, full * block :]


def _cache_names(cache: Any) -> list[str]:
    """``key.3`` / ``value.3`` of each K/V buffer, in the cache's order (runtime/backends/ort/verify.py bind_cache)."""
    return [f"{('key', 'value')[i % 2]}.{cache.kv_layers[i // 2]}" for i in range(len(cache.buffers))]
