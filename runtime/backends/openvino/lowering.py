"""The ort prefill graph's GroupQueryAttention lowered for OpenVINO's CPU plugin (placement's ``openvino-sdpa``).

OpenVINO's ONNX frontend translates com.microsoft GroupQueryAttention itself (``openvino-native``), but into
~50 runtime nodes a layer: its positions, cos/sin rows and causal mask rebuilt in every layer from that layer's
shapes, the K/V heads repeated by concatenation, the split in f32 with reorders around it. This module hands the
frontend its own translation (an ``openvino.frontend.onnx.ConversionExtension``) in the shapes the CPU plugin's
fusions take, as OpenVINO GenAI's own IR has them: RoPE on [B, S, H, D] before the transpose (fused into one
RoPE node), one opset13 ScaledDotProductAttention over the K/V heads broadcast, and the positions, cos/sin rows
and mask built once for all layers::

    qkv [B, S, (H + 2 Hkv) D] -> Reshape [B, S, H + 2 Hkv, D] -> VariadicSplit(axis 2) -> q, k, v -> Transpose [B, *, S, D]
    q, k: RoPE(cos[pos], sin[pos])        pos = P .. P + S - 1 (P = the past rows fed: shape(past_key)[2])
    present_k = Concat(past_k, k)  [B, Hkv, P + S, D]      present_v likewise
    SDPA(q, expand(present_k), expand(present_v), mask [S, P + S]: key j <= pos i, scale) -> [B, H, S, D]
    -> Transpose [B, S, H, D] -> Reshape [B, S, H D]

The same contract as the frontend's own translation (present = past + the new rows; the caller feeds the held
rows and copies the new ones back: native.py). What it does not translate (separate K/V inputs, interleaved
rotary, a softcap, a local window, smooth softmax, a batch of several rows with different lengths) it refuses
with a DecodertError at compile, so placement never chooses the candidate for such a graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from decodert.errors import DecodertError, first_line

DOMAIN = "com.microsoft"


def _const(v: Any, dtype: Any = np.int64) -> Any:
    import openvino.opset13 as op

    return op.constant(np.array(v, dtype))


def split(node: Any, half: bool = False, keep: list | None = None) -> list:
    """ONNX Split: a compressed matmul's product split on its last axis becomes one matmul per part
    (``split_matmul``); any other Split the VariadicSplit / Split the frontend makes of it."""
    import openvino.opset13 as op

    x = node.get_input(0)
    axis = int(node.get_attribute("axis")) if node.has_attribute("axis") else 0
    rank = x.get_partial_shape().rank
    last = axis == -1 or (rank.is_static and axis == rank.get_length() - 1)
    if node.get_input_size() > 1 and not _absent(node, 1):
        sizes_in = node.get_input(1)
        if last and sizes_in.get_node().get_type_name() == "Constant":
            parts = split_matmul(x, [int(v) for v in sizes_in.get_node().get_data().ravel()], half, keep)
            if parts is not None:
                return parts
        return list(op.variadic_split(x, _const(axis), sizes_in).outputs())
    if node.has_attribute("num_outputs"):
        return list(op.split(x, _const(axis), int(node.get_attribute("num_outputs"))).outputs())
    raise DecodertError("Split without sizes or num_outputs: not lowered for OpenVINO")


class GqaToSdpa:
    """The GroupQueryAttention translator; one instance per model read (it keeps the nodes all layers share)."""

    kernel = "SDPA"  # named in refusals

    def __init__(self, half: bool = False) -> None:
        self.half = half  # the split projections' decompression in f16 (a bf16 run), else f32 (exact)
        self.shared: dict[str, tuple] = {}  # the cos table's name -> ((cos rows, sin rows) | None, mask): built once
        self.refused: str | None = None  # what it did not lower (the frontend reports only that a node failed)
        # the frontend's u4 codes the lowered constants share (not copied): kept alive as long as this translator,
        # which the runner keeps as long as its compiled model
        self.kept: list = []

    def extension(self) -> Any:
        """The conversion extension to add to a Core before ``read_model`` of an ort prefill graph."""
        from openvino.frontend.onnx import ConversionExtension

        return ConversionExtension("GroupQueryAttention", DOMAIN, self)

    def extensions(self) -> list:
        """Every conversion extension of this lowering: GroupQueryAttention, Split and GatherBlockQuantized."""
        from openvino.frontend.onnx import ConversionExtension

        return [self.extension(), ConversionExtension("Split", lambda node: split(node, self.half, self.kept)),
                ConversionExtension("GatherBlockQuantized", DOMAIN, lambda node: self.gather_block_quantized(node))]

    def gather_block_quantized(self, node: Any) -> list:
        """com.microsoft GatherBlockQuantized (the int4 embedding table) as the decompression chain of the codes
        followed by the Gather, which the CPU plugin turns into one GatherCompressed over the u4 codes (the rows a
        call reads decompressed as it gathers them). OpenVINO's own translation folds the whole table to f32 (a
        1 GB constant for a 128256 x 2048 vocabulary). Refused (a DecodertError): another layout than the ort
        target's (4 bits, gather axis 0, blocks on the last axis of [V, K/block, block/2] codes, explicit zero
        points)."""
        import openvino as ov
        import openvino.opset13 as op

        attr = {k: int(node.get_attribute(k)) if node.has_attribute(k) else d
                for k, d in (("bits", 4), ("block_size", 128), ("gather_axis", 0), ("quantize_axis", 1))}
        codes, ids, scales = node.get_input(0), node.get_input(1), node.get_input(2)
        zeros = None if _absent(node, 3) else node.get_input(3)
        consts = [t.get_node() for t in (codes, scales, zeros) if t is not None]
        shape = codes.get_partial_shape()
        if (attr["bits"] != 4 or attr["gather_axis"] != 0 or zeros is None or not shape.is_static or len(shape) != 3
                or attr["quantize_axis"] != 2 or any(c.get_type_name() != "Constant" for c in consts)
                or shape[2].get_length() * 2 != attr["block_size"]):
            self.refused = f"GatherBlockQuantized with {attr} and its inputs' layout: not lowered for OpenVINO"
            raise DecodertError(self.refused)
        v, groups, half_block = (shape[i].get_length() for i in range(3))
        table = _u4(consts[0].get_data().reshape(-1), [v, groups, 2 * half_block], self.kept)  # the same bytes
        dt, np_dt = (ov.Type.f16, np.float16) if self.half else (ov.Type.f32, np.float32)
        zero = op.convert(op.constant(consts[2].get_data().reshape(v, groups, 1).astype(np.uint8)), dt)
        scale = op.constant(consts[1].get_data().reshape(v, groups, 1).astype(np_dt))
        weight = op.multiply(op.subtract(op.convert(table, dt), zero), scale)
        weight = op.reshape(weight, _const([v, groups * 2 * half_block]), False)
        if self.half:
            weight = op.convert(weight, ov.Type.f32)
        return [op.gather(weight, ids, _const(0)).output(0)]

    def check(self, node: Any) -> tuple[int, int, int, float, bool]:
        """(H, H_kv, D, scale, rotary) of a GroupQueryAttention node this lowering takes; what it does not take is
        refused (a DecodertError, also kept in ``refused`` for the compile error)."""
        attr = {name: node.get_attribute(name) if node.has_attribute(name) else default
                for name, default in (("num_heads", 0), ("kv_num_heads", 0), ("scale", 0.0), ("do_rotary", 0),
                                      ("rotary_interleaved", 0), ("softcap", 0.0), ("local_window_size", -1),
                                      ("smooth_softmax", 0))}
        h, hkv = int(attr["num_heads"]), int(attr["kv_num_heads"])
        unsupported = [k for k, ok in (("separate key/value inputs", _absent(node, 1) and _absent(node, 2)),
                                       ("rotary_interleaved", not attr["rotary_interleaved"]),
                                       ("softcap", not attr["softcap"]), ("local_window_size", attr["local_window_size"] < 0),
                                       ("smooth_softmax", not attr["smooth_softmax"]), ("num_heads", h > 0 and hkv > 0 and h % hkv == 0))
                       if not ok]
        if unsupported:
            self.refused = f"GroupQueryAttention with {', '.join(unsupported)}: not lowered for OpenVINO's {self.kernel}"
            raise DecodertError(self.refused)
        d = node.get_input(3).get_partial_shape()[3].get_length()
        return h, hkv, d, float(attr["scale"]) or 1.0 / float(np.sqrt(d)), bool(attr["do_rotary"])

    def __call__(self, node: Any) -> list:
        import openvino.opset13 as op

        c = _const
        h, hkv, d, scale, do_rotary = self.check(node)
        past_k, past_v = node.get_input(3), node.get_input(4)
        q, k, v = projections(node, h, hkv, d, self.half, self.kept)  # [B, S, *, D]
        q, k, v = (op.transpose(t, c([0, 2, 1, 3])) for t in (q, k, v))  # [B, *, S, D]
        cos = node.get_input(7) if do_rotary else None
        key = cos.get_node().get_friendly_name() if cos is not None else ""
        if key not in self.shared:  # every layer has the same S and P: build these once, from this layer's shapes
            s = op.gather(op.shape_of(node.get_input(0)), c([1]), c(0))  # [1]
            p = op.gather(op.shape_of(past_k), c([2]), c(0))  # [1] the rows fed: the new ones start there
            t = op.add(p, s)
            pos = op.range(op.squeeze(p, c(0)), op.squeeze(t, c(0)), c(1), "i64")  # [S]
            rows = None
            if cos is not None:  # [1, 1, S, D/2] each
                rows = tuple(op.unsqueeze(op.gather(table, pos, c(0)), c([0, 1])) for table in (cos, node.get_input(8)))
            keys = op.unsqueeze(op.range(c(0), op.squeeze(t, c(0)), c(1), "i64"), c(0))  # [1, P + S]
            self.shared[key] = (rows, op.less_equal(keys, op.unsqueeze(pos, c(1))))  # mask [S, P + S]
        rows, mask = self.shared[key]
        if rows is not None:
            q, k = _rope(q, *rows, d // 2), _rope(k, *rows, d // 2)
        present_k, present_v = op.concat([past_k, k], 2), op.concat([past_v, v], 2)  # [B, Hkv, P + S, D]
        attn = op.scaled_dot_product_attention(q, _expand(present_k, h, hkv, d), _expand(present_v, h, hkv, d), mask,
                                               op.constant(np.array(scale, np.float32)), causal=False)
        out = op.reshape(op.transpose(attn, c([0, 2, 1, 3])), c([0, 0, h * d]), True)  # [B, S, H D]
        return [out.output(0), present_k.output(0), present_v.output(0)]


class GqaToPaged(GqaToSdpa):
    """GroupQueryAttention as OpenVINO's PagedAttentionExtension (placement's ``openvino-paged``): the attention
    OpenVINO GenAI's own pipeline runs, whose prompt kernel skips the masked half of the causal square.

    The frontend cannot add graph inputs from a translator, so a layer's translation leaves a placeholder of the
    attention's shape (and records its q/k/v) and ``finish`` swaps in the PagedAttention nodes and their inputs after
    the read: per layer ``key_cache.i`` / ``value_cache.i`` (the plugin picks their element type and block layout at
    compile: [blocks, H_kv, block, D] in ``KV_CACHE_PRECISION``), shared ``past_lens``, ``subsequence_begins``,
    ``block_indices``, ``block_indices_begins`` and ``max_context_len``. The caller writes the held rows into the
    blocks before a call (runtime/backends/openvino/native.py); ``present_key.i`` / ``present_value.i`` become the
    call's new rows only ([B, H_kv, S, D], after RoPE; the caller may drop them and read the rows back from the
    blocks). The past length is the node's total sequence length minus the new rows (its ``past_key`` inputs are
    not read). One row a call (B = 1: the tables describe one sequence; a batch fails the attention's reshape)."""

    kernel = "PagedAttention"
    SHARED = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins", "max_context_len")

    def __init__(self, half: bool = False) -> None:
        super().__init__(half)
        self.layers: list[tuple] = []  # per layer: (its number, q [B, S, H D] (the placeholder), k, v [B, H_kv, S, D], H, H_kv, D, scale)

    def __call__(self, node: Any) -> list:
        import openvino as ov
        import openvino.opset13 as op

        c = _const
        h, hkv, d, scale, do_rotary = self.check(node)
        q, k, v = (op.transpose(t, c([0, 2, 1, 3])) for t in projections(node, h, hkv, d, self.half, self.kept))
        cos = node.get_input(7) if do_rotary else None
        key = cos.get_node().get_friendly_name() if cos is not None else ""
        if key not in self.shared:  # positions P .. P + S - 1, P = total - S: built once for all layers
            s = op.gather(op.shape_of(node.get_input(0)), c([1]), c(0))  # [1]
            t = op.convert(op.reshape(node.get_input(6), c([1]), False), ov.Type.i64)
            pos = op.range(op.squeeze(op.subtract(t, s), c(0)), op.squeeze(t, c(0)), c(1), "i64")  # [S]
            rows = None
            if cos is not None:  # [1, 1, S, D/2] each: RoPE on [B, H, S, D], the form the CPU plugin fuses
                rows = tuple(op.unsqueeze(op.gather(table, pos, c(0)), c([0, 1])) for table in (cos, node.get_input(8)))
            self.shared[key] = (rows, None)
        rows = self.shared[key][0]
        if rows is not None:
            q, k = _rope(q, *rows, d // 2), _rope(k, *rows, d // 2)
        hold = op.reshape(op.transpose(q, c([0, 2, 1, 3])), c([0, 0, h * d]), True)  # [B, S, H D]: the attention's place
        names = [n for n in node.get_input(3).get_names() if n.startswith("past_key.")]  # its layer: past_key.i
        layer = names[0].split(".", 1)[1] if names else str(len(self.layers))
        self.layers.append((layer, hold, k, v, h, hkv, d, scale))
        return [hold.output(0), k.output(0), v.output(0)]  # present_*: the new rows [B, H_kv, S, D]

    def finish(self, model: Any) -> None:
        """Swap each layer's placeholder for its PagedAttentionExtension node and add their inputs to ``model``."""
        import openvino as ov
        import openvino.opset13 as op
        from openvino._pyopenvino.op import _PagedAttentionExtension

        c = _const

        def param(name: str, shape: list, dtype: Any) -> Any:
            p = op.parameter(shape, dtype, name=name)
            p.output(0).get_tensor().set_names({name})
            return p

        shared = {n: param(n, [] if n == "max_context_len" else [-1], ov.Type.i32) for n in self.SHARED}
        params = list(shared.values())
        i32 = lambda v: op.constant(np.array(v, np.int32))  # noqa: E731
        none = lambda dt, rank=1: op.constant(np.zeros((0,) * rank, dt))  # noqa: E731  an input left empty
        for i, hold, k, v, h, hkv, d, scale in self.layers:
            caches = [param(f"{n}.{i}", [-1, -1, -1, -1], ov.Type.dynamic) for n in ("key_cache", "value_cache")]
            params += caches
            users = list(hold.output(0).get_target_inputs())  # what reads the attention: the output projection
            q = op.reshape(hold, c([-1, h * d]), False)  # the placeholder is q's own rows
            k2, v2 = (op.reshape(op.transpose(t, c([0, 2, 1, 3])), c([-1, hkv * d]), False) for t in (k, v))
            # PagedAttentionExtension's 28 inputs (OpenVINO 2026): q, k, v [tokens, heads * D]; the caches; the block
            # tables; scale, sliding window 0, no alibi; max context; then the score, rotation, xattention, sink and
            # adaptive-RKV inputs, all left empty (what optimum's paged transformation writes for a plain model)
            args = [q, k2, v2, *caches, shared["past_lens"], shared["subsequence_begins"],
                    shared["block_indices"], shared["block_indices_begins"], op.constant(np.array(scale, np.float32)),
                    i32(0), none(np.float32), shared["max_context_len"], none(np.int32), none(np.int32), none(np.int32),
                    none(np.float32), none(np.float32), i32(0), i32(0), none(np.float32, 4), i32(0), none(np.int32),
                    none(np.int32), none(np.int32), none(np.int32), none(np.uint8), none(np.int32)]
            try:
                pa = _PagedAttentionExtension([a.output(0) for a in args])
            except RuntimeError as e:  # another OpenVINO's input list
                self.refused = f"OpenVINO's PagedAttentionExtension takes other inputs here ({first_line(e)[:200]})"
                raise DecodertError(self.refused) from None
            info = pa.get_rt_info()
            for name, value in (("k_head_size", d), ("num_k_heads", hkv), ("v_head_size", d), ("num_v_heads", hkv)):
                info[name] = value
            out = op.reshape(pa.output(0), c([1, -1, h * d]), False)  # one row a call: [1, S, H D]
            for user in users:
                user.replace_source_output(out.output(0))
        model.add_parameters(params)
        model.validate_nodes_and_infer_types()


def _absent(node: Any, i: int) -> bool:
    """Is optional input ``i`` of ``node`` left empty (the packed-QKV form)?"""
    if node.get_input_size() <= i:
        return True
    try:
        return node.get_input(i).get_node().get_type_name() == "NullNode"
    except RuntimeError:
        return True


def projections(node: Any, h: int, hkv: int, d: int, half: bool, keep: list | None = None) -> tuple:
    """q [B, S, H, D], k and v [B, S, H_kv, D] of a GroupQueryAttention node's packed input: one compressed matmul
    each where the product is one (``split_matmul``), else the product split."""
    import openvino.opset13 as op

    c, qkv = _const, node.get_input(0)
    parts = split_matmul(qkv, [h * d, hkv * d, hkv * d], half, keep)
    if parts is not None:
        return tuple(op.reshape(t, c([0, 0, n, d]), True) for t, n in zip(parts, (h, hkv, hkv)))
    return tuple(op.variadic_split(op.reshape(qkv, c([0, 0, h + 2 * hkv, d]), True), c(2), c([h, hkv, hkv])).outputs())


def _rope(x: Any, cos: Any, sin: Any, half: int) -> Any:
    """Rotate-half RoPE of x [B, H, S, D] in the form the CPU plugin fuses: [x1 cos - x2 sin, x2 cos + x1 sin]."""
    import openvino.opset13 as op

    a, b = op.variadic_split(x, _const(-1), _const([half, half])).outputs()
    return op.concat([op.subtract(op.multiply(a, cos), op.multiply(b, sin)),
                      op.add(op.multiply(b, cos), op.multiply(a, sin))], -1)


def _expand(t: Any, h: int, hkv: int, d: int) -> Any:
    """[B, Hkv, T, D] -> [B, H, T, D], each K/V head repeated for its H / Hkv query heads (Broadcast, not copies)."""
    import openvino.opset13 as op

    if h == hkv:
        return t
    shape = op.shape_of(t)
    wide = op.concat([op.gather(shape, _const([0, 1]), _const(0)), _const([h // hkv]),
                      op.gather(shape, _const([2, 3]), _const(0))], 0)
    return op.reshape(op.broadcast(op.unsqueeze(t, _const(2)), wide), _const([0, h, -1, d]), True)



# ---- the fused projections split back into one FullyConnected each --------------------------------------------
# The ort target fuses q/k/v into one MatMulNBits and gate/up into another, then splits the product. On OpenVINO
# the split is a copy of every activation (and puts the q/k/v split in f32 beside the f32 cache); with one
# compressed matmul per part the CPU plugin fuses SiLU into the gate's FullyConnected and RoPE reads its own
# projection, as in OpenVINO GenAI's IR. The frontend reads MatMulNBits as a decompression chain over u4 codes:
#
#     MatMul(x, Reshape(Multiply(Subtract(Convert(W u4 [N, K/32, 32]), Convert(Z u4 [N, K/32, 1])),
#                                Reshape(Convert(S f32 [N K/32])))), transpose_b)     -> [.., N]
#
# and the parts are that chain over rows [a, b) of W, Z and S (a byte-aligned slice of the packed codes).
def split_matmul(y: Any, sizes: list[int], half: bool = False, keep: list | None = None) -> list | None:
    """``y`` (a compressed MatMul's output, last axis N = sum(sizes)) as one MatMul per part, or None where ``y``
    is not that chain or its rows are not byte-aligned in the packed codes (the caller splits ``y`` then)."""
    import openvino as ov
    import openvino.opset13 as op

    mm = y.get_node()
    if mm.get_type_name() != "MatMul" or not mm.get_attributes().get("transpose_b") or mm.get_attributes().get("transpose_a"):
        return None
    chain = _decompression(mm.input_value(1).get_node())
    if chain is None:
        return None
    w, z, s, shape = chain
    n, groups, block = w.get_output_partial_shape(0).to_shape()
    if sum(sizes) != n or (groups * block) % 2 or groups % 2:
        return None
    codes, zeros, scales = w.get_data(), z.get_data(), s.get_data().astype(np.float32).reshape(n, groups, 1)
    wb, zb = groups * block // 2, groups // 2  # bytes a row of W / of Z
    parts, a = [], 0
    for size in sizes:
        tw, tz = (_u4(data[a * n : (a + size) * n], shape, keep)
                  for data, n, shape in ((codes, wb, [size, groups, block]), (zeros, zb, [size, groups, 1])))
        dt = ov.Type.f16 if half else ov.Type.f32  # f16: the decompression OpenVINO's own int4 IRs have
        weight = op.multiply(op.subtract(op.convert(tw, dt), op.convert(tz, dt)),
                             op.constant(np.ascontiguousarray(scales[a : a + size]).astype(np.float16 if half else np.float32)))
        weight = op.reshape(weight, _const([size, shape[1]]), False)
        if half:
            weight = op.convert(weight, ov.Type.f32)
        parts.append(op.matmul(mm.input_value(0), weight, False, True).output(0))
        a += size
    return parts


def _u4(packed: np.ndarray, shape: list[int], keep: list | None) -> Any:
    """A u4 Constant of ``shape`` over ``packed`` (bytes, two codes each, the low one first): sharing its memory
    where ``keep`` holds it alive (the caller's list), else a copy."""
    import openvino as ov

    if keep is None:
        tensor = ov.Tensor(ov.Type.u4, shape)
        tensor.data[:] = packed.reshape(tensor.data.shape)
        return ov.op.Constant(tensor)
    packed = np.ascontiguousarray(packed)
    keep.append(packed)
    return ov.op.Constant(ov.Tensor(packed, shape, ov.Type.u4), shared_memory=True)


def _decompression(reshape: Any) -> tuple | None:
    """(W, Z, S constants, the [N, K] shape) of the MatMulNBits chain ending at ``reshape`` (None: another graph)."""
    try:
        if reshape.get_type_name() != "Reshape":
            return None
        shape = reshape.get_output_partial_shape(0).to_shape()
        mul = reshape.input_value(0).get_node()
        sub, sc = (mul.input_value(i).get_node() for i in (0, 1))
        if mul.get_type_name() != "Multiply" or sub.get_type_name() != "Subtract":
            return None
        w, z = (sub.input_value(i).get_node() for i in (0, 1))
        w, z = (t.input_value(0).get_node() if t.get_type_name() == "Convert" else None for t in (w, z))
        while sc is not None and sc.get_type_name() in ("Reshape", "Convert"):
            sc = sc.input_value(0).get_node()
        consts = (w, z, sc)
        if any(t is None or t.get_type_name() != "Constant" for t in consts):
            return None
        import openvino as ov

        if w.get_element_type() != ov.Type.u4 or z.get_element_type() != ov.Type.u4 or len(w.get_output_partial_shape(0)) != 3:
            return None
        return w, z, sc, shape
    except (RuntimeError, AttributeError, IndexError):
        return None
