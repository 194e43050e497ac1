"""One timed OpenVINO GenAI request, run by bench/compare.py and bench/sizes.py with the interpreter of the
environment OpenVINO GenAI is installed in (``--ov-venv``): it imports only numpy and openvino_genai.

    <venv>/bin/python bench/ovgenai_worker.py JOB_JSON

JOB_JSON: {"folder": optimum-cli's export, "threads": N, "ids": [...], "warmup_ids": [...], "gen": G,
"warmup": W, "batch": 1}. Loads ``LLMPipeline(folder, "CPU", INFERENCE_NUM_THREADS=N)`` (everything else
the pipeline's own defaults), runs ``warmup`` untimed greedy requests on ``warmup_ids`` (other ids than the
timed prompt: no prefix-cache hit), then one greedy request of ``ids`` with EOS ignored and exactly ``gen``
new tokens. A streamer stamps every token as the pipeline hands it out: prefill_s = generate() call to the
first token, step_s = the gaps between the following ones; the same contract as the other runners
(bench/competitors.py). Prints {"prefill_s", "step_s", "ttft_ms_own"} as JSON (``ttft_ms_own``: the
pipeline's own PerfMetrics TTFT, for reference).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as og


class Stamps(og.StreamerBase):
    """Records the clock at every token the pipeline streams."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def write(self, token):  # a token id, or a list of them
        self.times.extend([time.perf_counter()] * (len(token) if isinstance(token, list) else 1))
        return og.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


def request(pipe: og.LLMPipeline, ids: list[int], gen: int) -> tuple[float, list[float], float]:
    """One greedy request of exactly ``gen`` new tokens: (prefill_s, step_s, the pipeline's own TTFT ms)."""
    config = og.GenerationConfig(max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True, do_sample=False)
    tokens = np.asarray(ids, np.int64)[None]  # [1, L]
    inputs = og.TokenizedInputs(ov.Tensor(tokens), ov.Tensor(np.ones_like(tokens)))
    stamps = Stamps()
    t0 = time.perf_counter()
    out = pipe.generate(inputs, config, stamps)
    t = stamps.times
    if len(t) != gen or len(out.tokens[0]) != gen:
        raise RuntimeError(f"OpenVINO GenAI gave {len(out.tokens[0])} tokens ({len(t)} streamed), asked for {gen}")
    return t[0] - t0, np.diff(np.asarray(t)).tolist(), float(out.perf_metrics.get_ttft().mean)


def main(spec: str) -> int:
    job = json.loads(spec)
    pipe = og.LLMPipeline(job["folder"], "CPU", INFERENCE_NUM_THREADS=int(job["threads"]))
    if job.get("batch", 1) != 1:
        raise SystemExit("ovgenai_worker: batch 1 only (one token stream per request)")
    for _ in range(job.get("warmup", 1)):
        request(pipe, job["warmup_ids"], min(job["gen"], 4))
    prefill_s, steps, own = request(pipe, job["ids"], job["gen"])
    print(json.dumps({"prefill_s": prefill_s, "step_s": steps, "ttft_ms_own": own}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
