"""Progress of a TensorRT engine build on stderr: an ``IProgressMonitor`` over export/progress.py's Stage.

TensorRT reports nested phases ("Building engine" > "Building engine from subgraph" > "Computing
profile costs" > "Determining refit engines" ...); the top phase counts its steps. The monitor keeps
one Stage per engine: on a terminal a bar over the top phase with the phase running now as its
postfix, elsewhere (a log, CI, ``> build.log``) plain lines, the first after a second and then one
every 10 s naming the phase. ``build_serialized_network`` releases the GIL, so a ticker thread
keeps the clock moving through a long phase that reports no steps: with TensorRT-RTX 1.7 a SmolLM2
build sits longest in "Determining refit engines" (one step; on the tiny test graphs too it takes
half of each engine's build).
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any, TextIO

from decodert.export.progress import Stage, _is_terminal

TICK_S = 1.0  # the ticker's period: the bar's clock, and how late a plain line may be
# phases that take long without a step, described for a person watching
SLOW_PHASES = {"Determining refit engines": "Determining refit engines: the longest phase, it reports no steps"}


def make_progress(trt: ModuleType, label: str, enabled: bool, stream: TextIO | None = None) -> Any:
    """An IProgressMonitor for the build of engine ``label`` (None when ``enabled`` is False); ``close()`` it after."""
    if not enabled:
        return None

    class _Progress(trt.IProgressMonitor):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.stage: Stage | None = None
            self.top: str | None = None
            self.lock = threading.Lock()
            self.stop = threading.Event()
            self.ticker = threading.Thread(target=self._tick, daemon=True, name=f"decodert-build-{label}")

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            with self.lock:
                if parent_phase is None and self.stage is None:
                    self.top = phase_name
                    out = stream or sys.stderr
                    self.stage = Stage(f"building {label}.engine", total=num_steps, unit="step", stream=out,
                                       delay_s=0.0 if _is_terminal(out) else None)  # a bar at once; lines after 1 s
                    if not self.ticker.is_alive():
                        self.ticker.start()
                elif self.stage is not None:
                    self.stage.set_note(SLOW_PHASES.get(phase_name, phase_name))

        def step_complete(self, phase_name: str, step: int) -> bool:
            with self.lock:
                if self.stage is not None and phase_name == self.top:
                    self.stage.update(1)
            return True

        def phase_finish(self, phase_name: str) -> None:
            with self.lock:
                if self.stage is not None and phase_name == self.top:
                    self.stage.close()
                    self.stage, self.top = None, None

        def _tick(self) -> None:
            while not self.stop.wait(TICK_S):
                with self.lock:
                    if self.stage is not None:
                        self.stage.tick()

        def close(self) -> None:
            """Stop the ticker; a stage still open (a failed build) ends without a last line."""
            self.stop.set()
            with self.lock:
                if self.stage is not None:
                    self.stage.close(failed=True)
                    self.stage = None

    return _Progress()
