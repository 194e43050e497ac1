"""plugins/cuda_mem.py's CudaGraph against a scripted cuda-python runtime: what it frees when capture fails."""

from __future__ import annotations

import enum
import types

import pytest

from decodert.errors import DecodertError
from decodert.plugins import cuda_mem


class _Err(enum.Enum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


def _runtime(calls: list[str], fail: str | None) -> types.SimpleNamespace:
    def call(name, *values):
        def f(*_):
            calls.append(name)
            return (_Err.cudaErrorInvalidValue if name == fail else _Err.cudaSuccess, *values)
        return f

    return types.SimpleNamespace(
        cudaError_t=_Err, cudaGetErrorString=lambda e: (_Err.cudaSuccess, b"invalid value"),
        cudaStreamCaptureMode=types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=0),
        cudaStreamBeginCapture=call("begin"), cudaStreamEndCapture=call("end", "graph"),
        cudaGraphInstantiate=call("instantiate", "exec"), cudaGraphDestroy=call("graph_destroy"),
        cudaGraphExecDestroy=call("exec_destroy"), cudaGraphLaunch=call("launch"))


@pytest.mark.parametrize("fail", ["enqueue", "instantiate"])
def test_failed_capture_frees_its_graph(monkeypatch, fail):
    calls: list[str] = []
    monkeypatch.setattr(cuda_mem, "_rt", lambda: _runtime(calls, fail))
    stream = types.SimpleNamespace(handle=7)

    def enqueue():
        calls.append("enqueue")
        if fail == "enqueue":
            raise DecodertError("enqueue failed")

    with pytest.raises(DecodertError):
        cuda_mem.CudaGraph(stream, enqueue)
    assert calls[-1] == "graph_destroy" and "end" in calls  # the capture was ended, its graph freed


def test_capture_and_replay_then_destroy(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(cuda_mem, "_rt", lambda: _runtime(calls, None))
    graph = cuda_mem.CudaGraph(types.SimpleNamespace(handle=7), lambda: calls.append("enqueue"))
    graph.launch()
    graph.destroy()
    assert calls == ["begin", "enqueue", "end", "instantiate", "launch", "exec_destroy", "graph_destroy"]
