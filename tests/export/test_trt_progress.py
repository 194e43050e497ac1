"""export/trt_progress.py without TensorRT: a long phase with no steps still writes lines naming it."""

from __future__ import annotations

import io
import time
import types

from decodert.export import progress, trt_progress


class _Monitor:  # stands for trt.IProgressMonitor
    def __init__(self) -> None:
        pass


def test_a_long_phase_without_steps_is_never_silent(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    monkeypatch.setattr(trt_progress, "TICK_S", 0.01)
    err = io.StringIO()
    mon = trt_progress.make_progress(types.SimpleNamespace(IProgressMonitor=_Monitor), "decode", True, stream=err)
    mon.phase_start("Building engine", None, 6)
    mon.step_complete("Building engine", 0)
    mon.phase_start("Determining refit engines", "Computing profile costs", 1)
    time.sleep(0.3)  # no step: only the ticker can write
    lines = err.getvalue().splitlines()
    assert sum("Determining refit engines" in line for line in lines) >= 2, lines
    mon.phase_finish("Building engine")
    mon.close()
    assert err.getvalue().splitlines()[-1].endswith(" s done")
    assert trt_progress.make_progress(types.SimpleNamespace(IProgressMonitor=_Monitor), "x", False) is None
