"""Device memory, pinned host memory, streams and CUDA graphs through cuda-python (no torch, no pycuda).

Only what the TensorRT backend needs. Importing this module never touches CUDA; the first call
does (``cuda.bindings.runtime``), and a machine without cuda-python or a GPU gets a
DecodertError, or ``gpu_count() == 0`` from the probe.
"""

from __future__ import annotations

import ctypes
from types import ModuleType
from typing import Any

import numpy as np

from decodert.errors import DecodertError

CUDA_HINT = "pip install cuda-python"


def _rt() -> ModuleType:
    try:
        from cuda.bindings import runtime
    except ImportError as e:
        raise DecodertError(f"cuda-python is not installed ({e}): {CUDA_HINT}") from None
    return runtime


def check(result: Any, what: str = "CUDA call") -> Any:
    """Unwrap a cuda-python result tuple ``(err, *values)``; raise DecodertError on error."""
    rt = _rt()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        _, msg = rt.cudaGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise DecodertError(f"{what} failed: {getattr(err, 'name', err)}: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def gpu_count() -> int:
    """Number of CUDA devices; 0 without cuda-python, a driver or a GPU (never raises)."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return 0
    err, n = rt.cudaGetDeviceCount()
    return int(n) if err == rt.cudaError_t.cudaSuccess else 0


def device_info(device: int = 0) -> dict[str, Any]:
    """{"name", "compute_capability": "sm_90", "total_bytes"} of one device."""
    rt = _rt()
    props = check(rt.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return {"name": name, "compute_capability": f"sm_{props.major}{props.minor}", "total_bytes": int(props.totalGlobalMem)}


def set_device(device: int) -> None:
    """Select ``device`` and make its primary context current (TensorRT uses the runtime API's context)."""
    rt = _rt()
    check(rt.cudaSetDevice(device), "cudaSetDevice")
    check(rt.cudaFree(0), "CUDA context creation")


def clear_last_error() -> None:
    """Reset the runtime's last (non-sticky) error, e.g. after a failed stream capture."""
    _rt().cudaGetLastError()


def mem_get_info() -> tuple[int, int]:
    """(free, total) device bytes."""
    free, total = check(_rt().cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free), int(total)


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr`` (int), zeroed unless ``zero=False``; freed by ``free()``."""

    def __init__(self, nbytes: int, zero: bool = True) -> None:
        rt = _rt()
        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(check(rt.cudaMalloc(self.nbytes), f"cudaMalloc({self.nbytes} bytes)"))
        if zero:
            check(rt.cudaMemset(self.ptr, 0, self.nbytes), "cudaMemset")

    def free(self) -> None:
        if self.ptr:
            check(_rt().cudaFree(self.ptr), "cudaFree")
            self.ptr = 0


class PinnedArray:
    """A numpy array of ``shape``/``dtype`` in page-locked host memory (fast, async-safe copies)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        rt = _rt()
        self.dtype = np.dtype(dtype)
        self.nbytes = max(int(np.prod(shape)) * self.dtype.itemsize, 1)
        self.ptr = int(check(rt.cudaHostAlloc(self.nbytes, rt.cudaHostAllocDefault), "cudaHostAlloc"))
        raw = (ctypes.c_byte * self.nbytes).from_address(self.ptr)
        self.array = np.frombuffer(raw, dtype=np.uint8)[: int(np.prod(shape)) * self.dtype.itemsize]
        self.array = self.array.view(self.dtype).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            self.array = np.empty(0, self.dtype)  # drop the view before the memory goes
            check(_rt().cudaFreeHost(self.ptr), "cudaFreeHost")
            self.ptr = 0


class Stream:
    """A non-blocking CUDA stream; ``handle`` is the int TensorRT's execute_async_v3 takes."""

    def __init__(self) -> None:
        rt = _rt()
        self._stream = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")
        self.handle = int(self._stream)

    def sync(self) -> None:
        check(_rt().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def destroy(self) -> None:
        if self.handle:
            check(_rt().cudaStreamDestroy(self._stream), "cudaStreamDestroy")
            self.handle = 0


def copy_async(dst: int, src: int, nbytes: int, stream: Stream, kind: str) -> None:
    """kind: "h2d" | "d2h" | "d2d"; pointers are ints; host pointers should be pinned."""
    rt = _rt()
    kinds = {"h2d": rt.cudaMemcpyKind.cudaMemcpyHostToDevice, "d2h": rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
             "d2d": rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice}
    if nbytes > 0:
        check(rt.cudaMemcpyAsync(dst, src, nbytes, kinds[kind], stream.handle), f"cudaMemcpyAsync({kind})")


def copy_2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, stream: Stream) -> None:
    """Device-to-device strided copy: ``rows`` rows of ``width`` bytes."""
    rt = _rt()
    if width > 0 and rows > 0:
        check(rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows,
                                   rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream.handle), "cudaMemcpy2DAsync")


class CudaGraph:
    """Capture the work a callable enqueues on ``stream``; replay it with ``launch``."""

    def __init__(self, stream: Stream, enqueue: Any) -> None:
        rt = _rt()
        self.stream, self._exec, self._graph = stream, None, None
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(rt.cudaStreamBeginCapture(stream.handle, mode), "cudaStreamBeginCapture")
        try:
            try:
                enqueue()
            finally:  # always end the capture, or the stream stays unusable
                self._graph = check(rt.cudaStreamEndCapture(stream.handle), "cudaStreamEndCapture")
            self._exec = check(rt.cudaGraphInstantiate(self._graph, 0), "cudaGraphInstantiate")
        except BaseException:
            self.destroy()  # a failed capture frees what it made
            raise

    def launch(self) -> None:
        check(_rt().cudaGraphLaunch(self._exec, self.stream.handle), "cudaGraphLaunch")

    def destroy(self) -> None:
        rt = _rt()
        if self._exec is not None:
            check(rt.cudaGraphExecDestroy(self._exec), "cudaGraphExecDestroy")
            self._exec = None
        if self._graph is not None:
            check(rt.cudaGraphDestroy(self._graph), "cudaGraphDestroy")
            self._graph = None
