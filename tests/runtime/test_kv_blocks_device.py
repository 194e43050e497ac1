"""The device path of runtime/backends/kv_blocks.py (TensorRT's prefix-cache blocks) on a fake cuda_mem whose
"device memory" is one host byte array: the strided 2-D copies land where host_read/host_write put them."""

import numpy as np
import pytest

from decodert.plugins import cuda_mem
from decodert.runtime.backends import kv_blocks

MEM = np.zeros(1 << 20, np.uint8)


class _FakeBuffer:
    top = 1 << 19  # allocations above the cache buffers
    freed = 0

    def __init__(self, nbytes, zero=True):
        self.ptr, self.nbytes = _FakeBuffer.top, nbytes
        _FakeBuffer.top += nbytes

    def free(self):
        _FakeBuffer.freed += 1


def _copy_2d(dst, dpitch, src, spitch, width, rows, stream):
    for r in range(rows):
        MEM[dst + r * dpitch : dst + r * dpitch + width] = MEM[src + r * spitch : src + r * spitch + width].copy()


class _Stream:
    syncs = 0

    def sync(self):
        _Stream.syncs += 1


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(cuda_mem, "DeviceBuffer", _FakeBuffer)
    monkeypatch.setattr(cuda_mem, "copy_2d_async", _copy_2d)


def _views(slots=3, heads=2, max_seq=16, d=4, layers=2):
    shape, nbytes = (slots, heads, max_seq, d), slots * heads * max_seq * d * 4
    views = [MEM[i * nbytes : (i + 1) * nbytes].view(np.float32).reshape(shape) for i in range(2 * layers)]
    geo = kv_blocks.DeviceGeometry([i * nbytes for i in range(2 * layers)], heads * max_seq * d * 4, d * 4, heads, max_seq)
    return views, geo


def test_device_read_and_write_match_the_host_copies(fake_device):
    views, geo = _views()
    rng = np.random.default_rng(0)
    for v in views:
        v[...] = rng.standard_normal(v.shape, dtype=np.float32)
    expected = kv_blocks.host_read(views, 1, 5, 6)
    block = kv_blocks.device_read(geo, 1, 5, 6, _Stream())
    assert block.nbytes == geo.block_bytes(6) == expected.nbytes
    got = MEM[block.buffer.ptr : block.buffer.ptr + block.nbytes].view(np.float32).reshape(expected.shape)
    np.testing.assert_array_equal(got, expected)
    before = [v.copy() for v in views]
    kv_blocks.device_write(geo, 2, 3, block, _Stream())  # into another slot at another position
    for v, b in zip(views, before):
        np.testing.assert_array_equal(v[2, :, 3:9], b[1, :, 5:11])
        np.testing.assert_array_equal(v[:2], b[:2])  # other slots untouched
        np.testing.assert_array_equal(v[2, :, :3], b[2, :, :3])
        np.testing.assert_array_equal(v[2, :, 9:], b[2, :, 9:])
    freed = _FakeBuffer.freed
    kv_blocks.free_block(block)
    kv_blocks.free_block(expected)  # a host array: nothing to free
    assert _FakeBuffer.freed == freed + 1
