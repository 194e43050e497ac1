"""``native-cpu``: decodert's own decode step for dense llama-family int4 artifacts (docs/features/placement.md).

The ort target's decode graph is read as the recipe: its nodes are matched against the one layer pattern this
step runs (``read_graph``: embedding Gather / GatherBlockQuantized, RMSNorm, MatMulNBits qkv with an optional bias,
GroupQueryAttention with RoPE from the graph's cos/sin tables, MatMulNBits o, SkipSimplifiedLayerNormalization,
gate_up MatMulNBits + Split + SiLU, down, the final norm and the lm_head), and its MatMulNBits initializers are
repacked once from the weights file into the C kernel's tiles (decode_step.c). A graph with anything else (another
op, a scale, a softcap, a window, another block size) is refused in one line, and the placement keeps ``ort``.

``NativeDecode.forward`` runs rows' next tokens in one C call (``nd_forward``) over the rows' buffers of the same
``KVCache`` the prefill wrote: a batch's next tokens (one a row), or a verify's (a row's ids at its consecutive
next positions), or both: K (rotated) and V at each token's position, every layer, logits and the argmax out. The
weights are read once for every token of a call, and each token's arithmetic is that of a call with it alone, bit
for bit: a row's tokens do not depend on the rows beside it, and a verify pass scores each position exactly as the
plain step would (so speculation on this step keeps plain decoding's tokens). The caller
(runtime/backends/ort/backend.py) commits the ids inside ``writing`` as the ort decode does.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from decodert.errors import DecodertError
from decodert.artifact.manifest import Manifest
from decodert.artifact.targets import target_info
from decodert.runtime.backends.native import build

P = ctypes.c_void_p
LAYER_PTRS = ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down", "down_bias")
# the graph's bookkeeping (positions, the last token, the argmax, the outputs) besides the layers' ops
ALLOWED_OPS = {"Shape", "Gather", "Add", "Sub", "ReduceMax", "Cast", "Range", "Mul", "Reshape", "ArgMax", "Identity",
               "GatherBlockQuantized", "RMSNormalization", "MatMulNBits", "GroupQueryAttention",
               "SkipSimplifiedLayerNormalization", "Split", "Sigmoid"}


def refusal(manifest: Manifest) -> str | None:
    """Why this artifact has no ``native-cpu`` decode candidate, from its manifest and this machine (None: it may;
    its decode graph is checked when the step opens)."""
    if not target_info(manifest.target).native_reads_decode:
        return f"reads the ort target's decode graph, not a --target {manifest.target} one"
    q = manifest.quant
    if q is None or q.bits != 4 or q.block_size != 32 or q.accuracy_level != 4:
        return "only int4 block-32 weights at --accuracy-level 4 (int8 activations, as the C kernel computes)"
    if manifest.dtype != "fp32" or (manifest.kv_dtype or manifest.dtype) != "fp32":
        return f"{manifest.dtype} activations / {manifest.kv_dtype} cache: the native step runs fp32"
    if manifest.kv.states or manifest.model.images is not None or manifest.lora_layout is not None or manifest.plugin_ops:
        return "per-layer states, image inputs, LoRA slots or plugin nodes: the native step runs dense text layers only"
    if getattr(manifest.model.spec(), "mrope", None) is not None or manifest.model.spec().experts() is not None:
        return "M-RoPE or mixture-of-experts layers: the native step runs dense text layers only"
    return build.refusal()


@dataclass
class Mat:
    """One MatMulNBits product: its weights' initializer names and N, K."""

    q: str
    scales: str
    zero_points: str | None
    bias: str | None
    n: int
    k: int


@dataclass
class Layer:
    in_norm: str
    post_norm: str
    mats: dict[str, Mat] = field(default_factory=dict)  # "qkv", "o", "gate_up", "down"


@dataclass
class Recipe:
    """What ``read_graph`` found: the shapes and the initializer of every weight the step reads."""

    layers: list[Layer]
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    eps: float
    scale: float
    cos: str | None  # [max_pos, rot / 2] (None: no rotary)
    sin: str | None
    embed: tuple[str, ...]  # ("float", table) or ("q4", data, scales, zero_points | "")
    final_norm: str = ""
    lm_head: Mat | None = None


def _attrs(node: Any) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _through(producer: dict[str, Any], name: str) -> str:
    """``name`` followed back through Reshape / Gather nodes (the last-token selection) to what they select from."""
    node = producer.get(name)
    while node is not None and node.op_type in ("Reshape", "Gather"):
        name = node.input[0]
        node = producer.get(name)
    return name


def read_graph(graph: onnx.GraphProto, inits: dict[str, Any]) -> Recipe:
    """Match the decode graph against the native step's layer pattern; DecodertError names the first mismatch."""
    nodes = list(graph.node)
    bad = sorted({n.op_type for n in nodes} - ALLOWED_OPS)
    if bad:
        raise DecodertError(f"the decode graph has {', '.join(bad)} nodes, which the native step does not run")
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def only(name: str, op: str, what: str) -> Any:
        users = consumers.get(name, [])
        if len(users) != 1 or users[0].op_type != op:
            raise DecodertError(f"the decode graph's {what} is not one {op} (the native step's pattern)")
        return users[0]

    def mat(node: Any, what: str) -> Mat:
        a = _attrs(node)
        if a.get("bits") != 4 or a.get("block_size") != 32 or a.get("accuracy_level") != 4:
            raise DecodertError(f"the decode graph's {what} MatMulNBits is not int4 block 32 at accuracy level 4")
        ins = list(node.input) + [""] * 6
        if ins[4] or any(x and x not in inits for x in ins[1:6]):
            raise DecodertError(f"the decode graph's {what} MatMulNBits takes inputs the native step does not read")
        if a["K"] % 32:
            raise DecodertError(f"the decode graph's {what} MatMulNBits has K = {a['K']}, not a multiple of 32")
        return Mat(ins[1], ins[2], ins[3] or None, ins[5] or None, int(a["N"]), int(a["K"]))

    gqas = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    if not gqas:
        raise DecodertError("the decode graph has no GroupQueryAttention layers")
    L = len(gqas)
    counts = {op: sum(n.op_type == op for n in nodes) for op in ALLOWED_OPS}
    want = {"MatMulNBits": 4 * L + 1, "SkipSimplifiedLayerNormalization": 2 * L, "RMSNormalization": 1, "Split": L,
            "Sigmoid": L, "Mul": 2 * L + 1, "Add": 3}
    off = [f"{counts[op]} {op} (the pattern has {n})" for op, n in want.items() if counts[op] != n]
    if off:
        raise DecodertError(f"the decode graph has {', '.join(off)}: not the native step's layer pattern")
    layers: list[Layer] = []
    first = gqas[0]
    a0 = _attrs(first)
    heads, kv_heads = int(a0["num_heads"]), int(a0["kv_num_heads"])
    eps, cos, sin, embed_out = 0.0, None, None, None
    inter = 0
    prev_down = None
    for i, g in enumerate(gqas):
        a = _attrs(g)
        if (int(a["num_heads"]), int(a["kv_num_heads"])) != (heads, kv_heads) or a.get("rotary_interleaved", 0) \
                or a.get("softcap", 0.0) or a.get("local_window_size", -1) != -1 or a.get("smooth_softmax", 0) \
                or a.get("qk_output", 0) or len([o for o in g.output if o]) != 3:
            raise DecodertError(f"layer {i}'s GroupQueryAttention has attributes the native step does not run "
                                "(interleaved rotary, softcap, a window, smooth softmax)")
        ins = list(g.input) + [""] * 12
        if ins[1] or ins[2] or any(ins[9:12]):
            raise DecodertError(f"layer {i}'s GroupQueryAttention takes unpacked q/k/v or extra inputs")
        if a.get("do_rotary", 0):
            if ins[7] not in inits or ins[8] not in inits or (cos is not None and (ins[7], ins[8]) != (cos, sin)):
                raise DecodertError(f"layer {i}'s rotary tables are not the graph's one cos/sin pair")
            cos, sin = ins[7], ins[8]
        elif cos is not None:
            raise DecodertError("some layers rotate and some do not")
        qkv_node = producer.get(ins[0])
        if qkv_node is None or qkv_node.op_type != "MatMulNBits":
            raise DecodertError(f"layer {i}'s attention input is not one MatMulNBits (packed qkv)")
        norm = producer.get(qkv_node.input[0])
        if i == 0:
            if norm is None or norm.op_type != "RMSNormalization" or norm.output[0] != qkv_node.input[0]:
                raise DecodertError("layer 0's input norm is not an RMSNormalization")
            eps = float(_attrs(norm).get("epsilon", 1e-5))
            in_norm, embed_out = norm.input[1], norm.input[0]
        else:
            if norm is None or norm.op_type != "SkipSimplifiedLayerNormalization" or norm.output[0] != qkv_node.input[0] \
                    or prev_down not in norm.input[:2]:
                raise DecodertError(f"layer {i}'s input norm does not add the previous MLP's output to the residual")
            in_norm = norm.input[2]
        qkv = mat(qkv_node, f"layer {i} qkv")
        o_node = only(g.output[0], "MatMulNBits", f"layer {i} attention output")
        post = only(o_node.output[0], "SkipSimplifiedLayerNormalization", f"layer {i} o projection output")
        gu_node = only(post.output[0], "MatMulNBits", f"layer {i} post-attention norm output")
        split = only(gu_node.output[0], "Split", f"layer {i} gate_up output")
        gate_users = consumers.get(split.output[0], [])
        sig = next((n for n in gate_users if n.op_type == "Sigmoid"), None) if len(gate_users) == 2 else None
        mul1 = next((n for n in gate_users if n.op_type == "Mul"), None)
        if sig is None or mul1 is None or set(mul1.input) != {split.output[0], sig.output[0]}:
            raise DecodertError(f"layer {i}'s MLP activation is not SiLU (x * sigmoid(x))")
        mul2 = only(mul1.output[0], "Mul", f"layer {i} SiLU output")
        if set(mul2.input) != {mul1.output[0], split.output[1]}:
            raise DecodertError(f"layer {i}'s MLP is not silu(gate) * up")
        down_node = only(mul2.output[0], "MatMulNBits", f"layer {i} gated activation")
        gu = mat(gu_node, f"layer {i} gate_up")
        sizes = numpy_helper.to_array(inits[split.input[1]]).tolist() if len(split.input) > 1 and split.input[1] in inits else None
        if gu.n % 2 or sizes not in (None, [gu.n // 2] * 2) or _attrs(split).get("axis", 0) not in (-1, 1):
            raise DecodertError(f"layer {i}'s gate_up does not split into two equal halves")
        if i and inter != gu.n // 2:
            raise DecodertError("the layers' MLP sizes differ")
        inter = gu.n // 2
        layer = Layer(in_norm, post.input[2], {"qkv": qkv, "o": mat(o_node, f"layer {i} o"), "gate_up": gu,
                                               "down": mat(down_node, f"layer {i} down")})
        layers.append(layer)
        prev_down = down_node.output[0]
        if _attrs(post).get("epsilon", eps) != eps or (i and _attrs(norm).get("epsilon", eps) != eps):
            raise DecodertError("the norms' epsilons differ")
    hidden = layers[0].mats["qkv"].k
    head_dim = layers[0].mats["qkv"].n // (heads + 2 * kv_heads)
    if head_dim * (heads + 2 * kv_heads) != layers[0].mats["qkv"].n or layers[0].mats["o"].k != heads * head_dim:
        raise DecodertError("the qkv product's size is not (heads + 2 kv heads) x head_dim")
    scale = float(_attrs(first).get("scale", 0.0)) or 1.0 / float(np.sqrt(head_dim))
    # the embedding: layer 0's norm input, through a Reshape, from a Gather of the input ids
    src = producer.get(embed_out)
    while src is not None and src.op_type == "Reshape":
        src = producer.get(src.input[0])
    if src is not None and src.op_type == "Gather" and src.input[0] in inits and src.input[1] == "input_ids":
        embed: tuple[str, ...] = ("float", src.input[0])
    elif src is not None and src.op_type == "GatherBlockQuantized" and src.input[1] == "input_ids":
        a = _attrs(src)
        if a.get("bits", 4) != 4 or a.get("block_size") != 32 or a.get("gather_axis", 0) != 0 or a.get("quantize_axis") != 2:
            raise DecodertError("the embedding's GatherBlockQuantized is not 4-bit blocks of 32 along the hidden axis")
        embed = ("q4", src.input[0], src.input[2], src.input[3] if len(src.input) > 3 else "")
    else:
        raise DecodertError("the embedding is neither a float Gather nor a GatherBlockQuantized of the input ids")
    # the final norm adds the last MLP's output (after the last-token Gather); the head is one MatMulNBits
    lm_nodes = [n for n in nodes if n.op_type == "MatMulNBits" and consumers.get(n.output[0]) and
                any(c.op_type in ("ArgMax", "Identity") for c in consumers[n.output[0]])]
    if len(lm_nodes) != 1:
        raise DecodertError("the decode graph's logits are not one MatMulNBits")
    final = producer.get(lm_nodes[0].input[0])
    if final is None or final.op_type != "SkipSimplifiedLayerNormalization" or final.output[0] != lm_nodes[0].input[0] \
            or prev_down not in [_through(producer, x) for x in final.input[:2]]:
        raise DecodertError("the lm_head's input is not the final norm over the last MLP's output")
    lm = mat(lm_nodes[0], "lm_head")
    if lm.k != hidden or any(lay.mats["o"].n != hidden or lay.mats["down"].n != hidden or lay.mats["down"].k != inter
                             for lay in layers):
        raise DecodertError("the products' sizes do not chain (hidden, heads x head_dim, intermediate)")
    return Recipe(layers, hidden, heads, kv_heads, head_dim, inter, lm.n, eps, scale, cos, sin, embed,
                  final.input[2], lm)


class Weights:
    """An artifact graph's initializers as numpy arrays: views of the weights file (external data) or the graph's own."""

    def __init__(self, folder: Path, graph: onnx.GraphProto) -> None:
        self.folder, self.inits = folder, {t.name: t for t in graph.initializer}
        self._files: dict[str, np.memmap] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self.inits[name]
        if t.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        if info["location"] not in self._files:
            self._files[info["location"]] = np.memmap(self.folder / info["location"], np.uint8, mode="r")
        raw = self._files[info["location"]]
        start, count = int(info.get("offset", 0)), int(np.prod(t.dims, dtype=np.int64))
        return np.frombuffer(raw, dtype, count, start).reshape(tuple(t.dims))


def _aligned(nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes + 64, np.uint8)
    return buf[(-buf.ctypes.data) % 64:][:nbytes]


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32)


# the most tokens one C call takes (more are run in several calls, in order): its scratch is sized for them
MAX_TOKENS = 64


class NativeDecode:
    """The C decode step over an artifact's weights (packed once): the next tokens of rows, a batch's or a verify's."""

    def __init__(self, folder: Path, manifest: Manifest, threads: int | None = None) -> None:
        why = refusal(manifest)
        if why:
            raise DecodertError(f"{folder}: no native decode step: {why}")
        lib = self.lib = build.library()
        path = Path(folder) / manifest.graphs["decode"].file
        graph = onnx.load(str(path), load_external_data=False).graph
        w = Weights(Path(folder), graph)
        r = self.recipe = read_graph(graph, w.inits)
        kv = manifest.kv
        if (r.kv_heads, r.head_dim, len(r.layers)) != (kv.num_kv_heads, kv.head_dim, kv.num_layers):
            raise DecodertError(f"{path}: its attention ({len(r.layers)} layers, {r.kv_heads} x {r.head_dim}) is not "
                                "the manifest's cache")
        self.max_seq = manifest.max_seq
        keep: list[Any] = []  # every array the C model points into
        packed_sizes: list[int] = []  # the repacked products' bytes (what a step reads in full)

        def arr(a: np.ndarray) -> int:
            keep.append(a)
            return a.ctypes.data

        def packed(m: Mat) -> int:
            out = _aligned(lib.nd_packed_bytes(m.n, m.k))
            q = np.ascontiguousarray(w[m.q], np.uint8)
            s = _f32(w[m.scales])
            z = np.ascontiguousarray(w[m.zero_points], np.uint8) if m.zero_points else None
            if q.size != m.n * m.k // 2 or s.size != m.n * m.k // 32 or (z is not None and z.size != m.n * ((m.k // 32 + 1) // 2)):
                raise DecodertError(f"{path}: {m.q}'s initializers are not int4 blocks of 32 of [{m.n}, {m.k}]")
            lib.nd_pack(q.ctypes.data, s.ctypes.data, None if z is None else z.ctypes.data, m.n, m.k, out.ctypes.data)
            packed_sizes.append(out.nbytes)
            return arr(out)

        def bias(m: Mat) -> int | None:
            return arr(_f32(w[m.bias]).reshape(-1)) if m.bias else None

        rot_half, max_pos, cos, sin = 0, self.max_seq, None, None
        if r.cos is not None:
            cos, sin = _f32(w[r.cos]), _f32(w[r.sin])
            rot_half, max_pos = cos.shape[1], cos.shape[0]
            if 2 * rot_half > r.head_dim or sin.shape != cos.shape:
                raise DecodertError(f"{path}: its rotary tables {list(cos.shape)} do not fit head_dim {r.head_dim}")
        ptrs: list[int | None] = [arr(cos) if cos is not None else None, arr(sin) if sin is not None else None]
        if r.embed[0] == "float":
            table = w[r.embed[1]]
            if table.dtype != np.float32 or table.shape != (r.vocab, r.hidden):
                raise DecodertError(f"{path}: its embedding table is not fp32 [{r.vocab}, {r.hidden}]")
            ptrs += [arr(table), None, None, None]
        else:
            data, scales = w[r.embed[1]], _f32(w[r.embed[2]])
            zps = np.ascontiguousarray(w[r.embed[3]], np.uint8) if r.embed[3] else None
            nb = r.hidden // 32
            if data.size != r.vocab * nb * 16 or scales.size != r.vocab * nb or (zps is not None and zps.size != r.vocab * nb):
                raise DecodertError(f"{path}: its quantized embedding is not [{r.vocab}, {r.hidden}] in blocks of 32")
            ptrs += [None, arr(np.ascontiguousarray(data, np.uint8)), arr(scales), None if zps is None else arr(zps)]
        ptrs += [arr(_f32(w[r.final_norm])), packed(r.lm_head), bias(r.lm_head)]
        layer_ptrs: list[int | None] = []
        for lay in r.layers:
            layer_ptrs += [arr(_f32(w[lay.in_norm])), arr(_f32(w[lay.post_norm]))]
            for name in ("qkv", "o", "gate_up", "down"):
                layer_ptrs += [packed(lay.mats[name]), bias(lay.mats[name])]
        verify = manifest.graphs.get("verify")
        self.max_tokens = min(MAX_TOKENS, max(1, manifest.max_batch) * max(1, (verify.max_tokens or 1) if verify else 1))
        dims = np.array([len(r.layers), r.hidden, r.heads, r.kv_heads, r.head_dim, r.inter, r.vocab, rot_half, max_pos,
                         0 if r.embed[0] == "float" else 1, self.max_seq, self.max_tokens], np.int32)
        fparams = np.array([r.eps, r.scale], np.float32)
        self._keep = keep
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.threads = lib.nd_start(int(threads or os.environ.get("DECODERT_THREADS", "0") or 0) or cores)
        self._ptrs = ((P * len(ptrs))(*ptrs), (P * len(layer_ptrs))(*layer_ptrs))
        self.handle = lib.nd_create(dims.ctypes.data, fparams.ctypes.data, self._ptrs[0], self._ptrs[1])
        if not self.handle:
            raise DecodertError(f"{path}: out of memory for the native decode step's buffers")
        self.stride = -(-r.vocab // 16) * 16  # a token's logits row, as the C products write it
        self.logits = np.zeros((self.max_tokens, self.stride), np.float32)
        self.best = np.zeros(self.max_tokens, np.int64)
        self.packed_bytes = sum(packed_sizes)  # read in full by every call (the embedding: one row a token)
        self._rows: dict[int, tuple[Any, int, np.ndarray]] = {}  # slot -> (the cache, weakly; id of its buffers; K/V pointers)
        self._calls = (np.zeros(self.max_tokens, np.int64), np.zeros(self.max_tokens, np.int32),
                       np.zeros((self.max_tokens, 2 * len(r.layers)), np.uint64))  # a call's tokens, positions, K/V

    def _pointers(self, cache: Any, slot: int) -> np.ndarray:
        """``slot``'s K and V bases in ``cache`` (every layer's, in the order of its buffers)."""
        row = self._rows.get(slot)
        if row is None or row[0]() is not cache or row[1] != id(cache.buffers):  # weak: a dropped cache is not kept
            if cache.device != "cpu" or cache.dtype != np.float32 or cache.max_seq != self.max_seq or not cache.buffers:
                raise DecodertError("the native decode step runs over an fp32 host cache of the artifact's max_seq")
            pointers = np.array([cache.pointer(i, slot) for i in range(len(cache.buffers))], np.uint64)
            row = self._rows[slot] = (weakref.ref(cache), id(cache.buffers), pointers)
        return row[2]

    def step(self, cache: Any, slot: int, token: int) -> tuple[int, np.ndarray]:
        """Run ``token`` at row ``slot``'s next position (K/V written there); (argmax, logits [V]). The caller commits."""
        best, logits = self.forward(cache, [slot], [np.array([token], np.int64)])
        return int(best[0]), logits[0]

    def forward(self, cache: Any, slots: list[int], ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Each ``ids[j]`` [n_j] at row ``slots[j]``'s next positions (``lengths[slot]`` ..), K/V written there:
        (argmax [sum n_j], logits [sum n_j, V]) in that order, row after row. The caller commits the ids."""
        tokens, positions, kv = self._calls
        flat = [(self._pointers(cache, slot), int(t), int(cache.lengths[slot]) + i)
                for slot, row in zip(slots, ids) for i, t in enumerate(np.asarray(row).reshape(-1))]
        vocab, cap = self.recipe.vocab, self.max_tokens
        if len(flat) <= cap:
            return self._call(flat, tokens, positions, kv), self.logits[: len(flat), :vocab]
        best, logits = np.empty(len(flat), np.int64), np.empty((len(flat), vocab), np.float32)
        for start in range(0, len(flat), cap):  # in order: a later call reads the K/V an earlier one wrote
            part = flat[start : start + cap]
            best[start : start + len(part)] = self._call(part, tokens, positions, kv)
            logits[start : start + len(part)] = self.logits[: len(part), :vocab]
        return best, logits

    def _call(self, flat: list[tuple[np.ndarray, int, int]], tokens: np.ndarray, positions: np.ndarray,
              kv: np.ndarray) -> np.ndarray:
        n = len(flat)
        for i, (pointers, token, pos) in enumerate(flat):
            kv[i], tokens[i], positions[i] = pointers, token, pos
        if self.lib.nd_forward(self.handle, n, tokens.ctypes.data, positions.ctypes.data, kv.ctypes.data,
                               self.logits.ctypes.data, self.stride, self.best.ctypes.data) < 0:
            bad = [(t, p) for _, t, p in flat if not (0 <= t < self.recipe.vocab and 0 <= p < self.max_seq)]
            raise DecodertError(f"the native decode step cannot run token {bad[0][0] if bad else '?'} at position "
                                f"{bad[0][1] if bad else '?'} (vocabulary {self.recipe.vocab}, max_seq {self.max_seq})")
        return self.best[:n].copy()

    def close(self) -> None:
        if getattr(self, "handle", None):
            self.lib.nd_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.close()
