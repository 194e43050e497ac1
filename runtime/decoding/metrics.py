"""Per-request timing and memory numbers, as a dataclass."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass


@dataclass
class Metrics:
    """What one request cost. Rates are 0.0 when undefined (e.g. one generated token)."""

    ttft_s: float  # request admitted -> first generated token
    prompt_tokens: int
    prompt_tps: float  # prompt tokens / prefill time
    generated_tokens: int
    decode_tps: float  # tokens after the first / time after the first
    tpot_ms: float  # mean time per output token after the first
    peak_rss_mb: float  # process peak resident set size
    total_s: float
    # speculative decoding (0 without it): tokens committed per target pass after the first token,
    # and the share of drafted tokens the target accepted
    accepted_per_step: float = 0.0
    acceptance_rate: float = 0.0
    cached_tokens: int = 0  # prompt tokens reused from a session's row or the prefix cache (not prefilled)
    placement: str = ""  # which backend ran each phase, "prefill=openvino decode=ort" ("": the backend's only one)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line for stderr, e.g. ``prompt 12 tok @ 850.1 tok/s | ...``."""
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (f"prompt {self.prompt_tokens} tok{cached} @ {self.prompt_tps:.1f} tok/s | ttft {self.ttft_s * 1000:.1f} ms | "
                f"gen {self.generated_tokens} tok @ {self.decode_tps:.1f} tok/s ({self.tpot_ms:.2f} ms/tok) | "
                f"peak rss {self.peak_rss_mb:.0f} MB"
                + (f" | spec {self.accepted_per_step:.2f} tok/step, {100 * self.acceptance_rate:.0f}% accepted"
                   if self.accepted_per_step else "")
                + (f" | {self.placement}" if self.placement else ""))


def peak_rss_mb() -> float:
    """Peak RSS of this process in MiB: Linux's VmHWM, which is this process's own (ru_maxrss is kept
    across fork and exec, so a worker forked from a large parent reported the parent's peak); elsewhere
    ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


class Timer:
    """Timestamps of one request: ``start()`` at admission, ``token()`` per generated token."""

    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self.t_start = self.t_first = self.t_last = 0.0
        self.tokens = 0

    def start(self) -> None:
        self.t_start = self._clock()

    def token(self) -> None:
        now = self._clock()
        if self.tokens == 0:
            self.t_first = now
        self.t_last = now
        self.tokens += 1

    def metrics(self, prompt_tokens: int, cached_tokens: int = 0, placement: str = "") -> Metrics:
        ttft = self.t_first - self.t_start if self.tokens else 0.0
        decode_s = self.t_last - self.t_first
        after_first = max(self.tokens - 1, 0)
        return Metrics(
            ttft_s=ttft,
            prompt_tokens=prompt_tokens,
            prompt_tps=prompt_tokens / ttft if ttft > 0 else 0.0,
            generated_tokens=self.tokens,
            decode_tps=after_first / decode_s if decode_s > 0 and after_first else 0.0,
            tpot_ms=1000 * decode_s / after_first if after_first else 0.0,
            peak_rss_mb=peak_rss_mb(),
            total_s=(self.t_last - self.t_start) if self.tokens else 0.0,
            cached_tokens=cached_tokens,
            placement=placement,
        )
