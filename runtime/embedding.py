"""``LLM.embed``: texts or token-id lists -> unit vectors [n, d] from embed.onnx (manifest ``embedding``).

    ids      text: the tokenizer's own encoding with its special tokens (its post-processor: Qwen3-Embedding
             appends <|endoftext|>), BOS as the manifest says; token ids: used as they are
    batches  inputs sorted by length, at most the artifact's max_batch rows a call, right-padded; results in the
             caller's order (a row's vector does not depend on its batch: the graph masks every other row's keys)
    pool     hidden [B,S,hidden] -> [B,hidden] by the record's rule: "last" valid token | "mean" over the valid
             tokens | "cls" (the first)
    dense    each dense layer in order: x @ weight^T + bias
    unit     x / max(|x|, 1e-12);  ``dimensions`` k < d (a matryoshka model only): x[:, :k], normalised again

embed.onnx has its own ONNX Runtime session, opened on the first call; it shares nothing with the engine's
cache, so a call runs beside a generation in another thread (each takes its own cores on the CPU).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from decodert.errors import DecodertError, RequestError
from decodert.artifact.manifest import Manifest
from decodert.runtime import validate

EmbedInput = str | Sequence[int] | np.ndarray


class Embedder:
    """embed.onnx of one artifact folder and the manifest's pooling rule."""

    def __init__(self, folder: Path, manifest: Manifest, tokenizer: Any, bos_token_id: int | None,
                 add_bos_token: bool | None):
        if manifest.embedding is None:
            raise DecodertError(f"{folder} has no embedding graph; re-export the model with "
                                "`decodert export SRC -o OUT --embeddings`")
        self.folder, self.record, self.tokenizer = Path(folder), manifest.embedding, tokenizer
        self.max_seq, self.max_batch = manifest.max_seq, manifest.max_batch
        self.vocab_size = manifest.model.vocab_size
        self.bos_token_id, self.add_bos_token = bos_token_id, add_bos_token
        self._session: Any = None
        self._dense: list[tuple[np.ndarray, np.ndarray | None]] | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, folder: Path | str, verify: str = "fast") -> "Embedder":
        """The embedder of an artifact folder without its generation backend (``decodert embed``)."""
        from decodert.artifact.manifest import tokenizer_file
        from decodert.runtime.backends.loading import open_tokenizer, read_manifest

        folder = Path(folder)
        manifest = read_manifest(folder, verify)
        tokenizer_file(manifest, folder)
        tok = manifest.tokenizer
        bos = tok.bos_token_id if tok.bos_token_id is not None else manifest.model.bos_token_id
        return cls(folder, manifest, open_tokenizer(folder, manifest), bos, tok.add_bos_token)

    @property
    def dimensions(self) -> int:
        """The full vector size."""
        assert self.record.dimensions is not None
        return self.record.dimensions

    def check_dimensions(self, dimensions: int | None) -> int:
        """The vector size a call returns: ``dimensions`` (None: the full size); RequestError when the model
        cannot give it."""
        full = self.dimensions
        if dimensions is None:
            return full
        if type(dimensions) is not int or dimensions < 1:
            raise RequestError(f"dimensions must be a positive integer, got {dimensions!r}", "dimensions")
        if dimensions > full or (dimensions < full and not self.record.matryoshka):
            allowed = f"1 to {full}" if self.record.matryoshka else f"only {full} (it was not trained for shorter vectors)"
            raise RequestError(f"dimensions {dimensions}: this model's vectors have {full} dimensions; it allows "
                               f"{allowed}", "dimensions")
        return dimensions

    def token_ids(self, inputs: Sequence[EmbedInput]) -> list[np.ndarray]:
        """Each input's ids [L] int64, checked: 1 <= L <= max_seq, ids below the vocabulary size."""
        if isinstance(inputs, (str, np.ndarray)) or not isinstance(inputs, (list, tuple)) or not inputs:
            raise RequestError("input must be a non-empty list of texts or of token id lists", "input")
        return [self._ids(x, f"input[{i}]") for i, x in enumerate(inputs)]

    def _ids(self, item: EmbedInput, what: str) -> np.ndarray:
        if isinstance(item, str):
            validate.check_text(item, what)
            if len(item) > self.max_seq * validate.CHARS_PER_TOKEN:
                raise RequestError(f"{what} has {len(item):,} characters: far more than the {self.max_seq} tokens "
                                   "this model takes (--max-seq)", "input")
            try:
                ids = list(self.tokenizer.encode(item, add_special_tokens=True).ids)
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as e:  # noqa: BLE001 - a Rust panic in tokenizers is a BaseException
                raise RequestError(f"the tokenizer failed on {what} ({type(e).__name__}: {str(e)[:120]})", "input") from None
            if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids.insert(0, int(self.bos_token_id))
            arr = np.asarray(ids, dtype=np.int64)
        else:
            try:
                arr = validate.token_ids(item, what)
            except DecodertError as e:
                raise RequestError(str(e), "input") from None
            if arr.size and int(arr.max()) >= self.vocab_size:
                raise RequestError(f"{what}: token id {int(arr.max())} is not below the vocabulary size "
                                   f"{self.vocab_size}", "input")
        if arr.size == 0:
            raise RequestError(f"{what} has no tokens (the tokenizer gives none for an empty text); "
                               "embed at least one token", "input")
        if arr.size > self.max_seq:
            raise RequestError(f"{what} has {arr.size} tokens; this model takes at most {self.max_seq} (--max-seq)",
                               "input")
        return arr

    def embed(self, ids: Sequence[np.ndarray], dimensions: int | None = None) -> np.ndarray:
        """Checked ids (``token_ids``) -> unit vectors [n, dimensions] float32, in the inputs' order."""
        size = self.check_dimensions(dimensions)
        out = np.empty((len(ids), self.dimensions), np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), self.max_batch):
            rows = order[start:start + self.max_batch]
            out[rows] = self._vectors([ids[i] for i in rows])
        if size < self.dimensions:
            out = out[:, :size]
        return unit(out)

    def _vectors(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """One call of embed.onnx over ``ids`` -> pooled, projected vectors [n, d] (not normalised)."""
        lengths = np.asarray([len(x) for x in ids], np.int64)
        batch = np.zeros((len(ids), int(lengths.max())), np.int64)  # right padding: the pad id is never seen
        for b, x in enumerate(ids):
            batch[b, :len(x)] = x
        session, dense = self._open()
        hidden = session.run(["hidden"], {"input_ids": batch, "seq_lengths": lengths})[0]  # [B, S, hidden]
        x = pool(hidden, lengths, self.record.pooling)
        for weight, bias in dense:
            x = x @ weight.T + (bias if bias is not None else 0.0)
        return x

    def _open(self) -> tuple[Any, list[tuple[np.ndarray, np.ndarray | None]]]:
        """The session and the dense layers, loaded once (the first caller opens them, others wait)."""
        with self._lock:
            if self._session is None:
                from decodert.runtime.backends.ort_session import default_providers, open_session, session_options

                self._dense = [_dense(self.folder, d.file) for d in self.record.dense]
                self._session = open_session(self.folder / self.record.graph.file, session_options(None),
                                             default_providers())
            assert self._dense is not None
            return self._session, self._dense


def pool(hidden: np.ndarray, lengths: np.ndarray, rule: str) -> np.ndarray:
    """hidden [B,S,D], valid lengths [B] -> [B,D] float32 by ``rule`` ("last" | "mean" | "cls")."""
    rows = np.arange(len(lengths))
    if rule == "last":
        return hidden[rows, lengths - 1].astype(np.float32)
    if rule == "cls":
        return hidden[:, 0].astype(np.float32)
    valid = (np.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(np.float32)  # [B,S]
    return (np.einsum("bsd,bs->bd", hidden.astype(np.float32), valid) / lengths[:, None]).astype(np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (a zero row stays zero)."""
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def _dense(folder: Path, file: str) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        with np.load(folder / file) as z:
            return z["weight"].astype(np.float32), (z["bias"].astype(np.float32) if "bias" in z else None)
    except (OSError, KeyError, ValueError) as e:
        raise DecodertError(f"{folder / file}: cannot read the dense layer ({type(e).__name__})") from None

