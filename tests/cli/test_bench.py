"""`decodert bench` on tiny exported models: it runs, writes the documented JSON, refuses bad arguments.

No timing assertions: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from decodert.cli import main
from decodert.export import progress
from decodert.artifact.manifest import load_manifest
from decodert.export.pipeline import export_model
from decodert.export.quantize.quant import QuantConfig
from decodert.tools.bench import bytes_per_step

SPREAD = {"median", "min", "max"}
BATCH_FIELDS = {"batch", "ttft_ms", "prompt_tps", "decode_tps", "tpot_ms", "gbps", "step_ms"}
TOP_FIELDS = {"artifact", "model", "dtype", "quant", "backend", "threads", "prompt_len", "gen", "warmup", "repeats",
              "weights_file_bytes", "bytes_per_step", "copy_gbps", "read_gbps", "floor_tps", "peak_rss_mb", "load_s", "machine",
              "results"}


@pytest.fixture(scope="module")
def tiny_artifact(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tied"
    export_model(tiny_checkpoint("llama_tied"), out, max_seq=64, max_batch=2, progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_int4_artifact(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tied-int4"
    export_model(tiny_checkpoint("llama_tied"), out, max_seq=64, max_batch=2, progress=False,
                 quant=QuantConfig(bits=4, accuracy_level=4))
    return out


def _bench(out, *extra: str) -> int:
    return main(["bench", str(out), "--prompt-len", "8", "--gen", "5", "--repeats", "2", "--warmup", "1", *extra])


def test_bench_runs_and_writes_json(tiny_artifact, tmp_path, capsys):
    report = tmp_path / "bench.json"
    assert _bench(tiny_artifact, "--batch", "1,2", "--threads", "1", "--json", str(report)) == 0
    table = capsys.readouterr().out
    assert "decode tok/s" in table and "floor" in table
    data = json.loads(report.read_text())
    assert TOP_FIELDS <= set(data)
    assert (data["prompt_len"], data["gen"], data["repeats"], data["threads"]) == (8, 5, 2, 1)
    assert [r["batch"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert BATCH_FIELDS <= set(r)
        for name in ("ttft_ms", "prompt_tps", "decode_tps", "tpot_ms", "gbps"):
            assert set(r[name]) == SPREAD
            assert 0 < r[name]["min"] <= r[name]["median"] <= r[name]["max"]
        assert len(r["step_ms"]) == 4  # gen - 1 decode steps
    assert data["copy_gbps"] > 0 and data["read_gbps"] > 0 and data["floor_tps"] > 0 and data["peak_rss_mb"] > 0


def test_bench_plot_is_a_png(tiny_artifact, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "steps.png"
    assert _bench(tiny_artifact, "--plot", str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--batch", "3"], "exceeds the artifact's --max-batch 2"),
    (["--prompt-len", "60", "--gen", "5"], "exceeds the artifact's --max-seq 64"),
    (["--gen", "0"], "--gen must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--batch", "0"], "--batch sizes must be >= 1"),
])
def test_bench_rejects_bad_arguments(tiny_artifact, capsys, args, message):
    assert main(["bench", str(tiny_artifact), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("decodert: error:") and message in err and "\n" not in err


def test_bench_unparsable_batch_exits_2(tiny_artifact, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny_artifact), "--batch", "one"])
    assert e.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_bench_missing_artifact_exits_2(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("decodert: error:")


def test_bytes_per_step_counts_one_embedding_row_when_the_head_is_a_copy(tiny_artifact, tiny_int4_artifact):
    tied = load_manifest(tiny_artifact)
    embed_bytes = 512 * 64 * 4  # tiny vocab x hidden, fp32
    # fp32 tied: the output projection reads the whole table, so it counts in full
    full = bytes_per_step(tiny_artifact, tied)
    assert full > embed_bytes
    assert full <= tied.weights.bytes + 1024  # + small inline constants; RoPE tables count one row
    # int4, tied: the quantized head is read in full, its gather-only scale tables one row per token,
    # and no float table is stored at all
    q = load_manifest(tiny_int4_artifact)
    per_step = bytes_per_step(tiny_int4_artifact, q)
    names = {t.name for t in onnx.load(tiny_int4_artifact / "decode.onnx", load_external_data=False).graph.initializer}
    assert "embed" not in names and q.weights.bytes < embed_bytes
    gather_tables = 512 * 2 * 4  # vocab x blocks (64 / 32) fp32 scales, counted one row per token
    assert per_step <= q.weights.bytes - gather_tables + 1024
    assert bytes_per_step(tiny_int4_artifact, q, rows=2) == per_step + 2 * 4 + 2  # a row of scales + zero points


def test_bench_reports_progress_on_stderr_when_not_a_terminal(tiny_artifact, monkeypatch, capsys):
    """`decodert bench` used to be silent for minutes when its output went to a file (issue 17)."""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)  # a line per run instead of one per 10 s
    assert _bench(tiny_artifact, "--batch", "1") == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("decodert: bench tied (batch 1): ")]
    assert [line.split(": ")[2].split(",")[0] for line in lines[:-1]] == [f"{i}/4 run" for i in range(1, 5)]
    assert lines[-1].endswith(" s done") and "decodert: bench" not in out  # stdout keeps only the report


def _bench_script(name: str, *args: str) -> subprocess.CompletedProcess:
    script = Path(__file__).resolve().parents[2] / "bench" / name
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)


def test_kernel_ceiling_times_the_artifacts_matmulnbits(tiny_int4_artifact):
    proc = _bench_script("kernel_ceiling.py", "--artifact", str(tiny_int4_artifact), "--iters", "3")
    assert proc.returncode == 0, proc.stderr
    n = sum(node.op_type == "MatMulNBits"
            for node in onnx.load(tiny_int4_artifact / "decode.onnx", load_external_data=False).graph.node)
    assert proc.stdout.startswith(f"{n} MatMulNBits (int4, block 32, accuracy level 4, batch 1") and "tok/s" in proc.stdout


def test_ab_alternates_artifacts_in_workers(tiny_artifact, tiny_int4_artifact):
    proc = _bench_script("ab.py", str(tiny_artifact), str(tiny_int4_artifact), "--rounds", "2", "--prompt-len", "4",
                         "--gen", "4")
    assert proc.returncode == 0, proc.stderr
    summary = [line for line in proc.stdout.splitlines() if "median of medians" in line]
    assert len(summary) == 2 and all("(rounds: " in line and line.count(".") >= 3 for line in summary)


def test_prefix_bench_runs_on_a_tiny_artifact(tiny_checkpoint, tmp_path):
    """bench/prefix.py end to end on a tiny export (no competitors): every part reports, replies match."""
    art = tmp_path / "prefix"
    export_model(tiny_checkpoint("llama"), art, max_seq=512, max_batch=2, progress=False)
    out = tmp_path / "prefix.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "prefix.py"
    proc = subprocess.run([sys.executable, str(bench), "--artifact", str(art), "--small-artifact", str(art),
                           "--turns", "3", "--reply", "4", "--requests", "3", "--gen", "3", "--system-words", "40", "--rounds", "1",
                           "--memory-turns", "12", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    conv = data["conversation"]
    assert set(conv["ttft_ms"]) == {"decodert session", "decodert re-prefill"}
    assert all(len(v) == 3 for v in conv["ttft_ms"].values()) and conv["same_tokens"]
    assert conv["cached_tokens"][0] == 0 and conv["cached_tokens"][2] > 0
    assert data["shared"]["same_tokens"] and data["shared"]["cached_tokens"] > 0
    mem = data["memory"]
    assert mem["max_held_bytes"] <= mem["budget_bytes"] and mem["peak_bytes"] <= mem["budget_bytes"]
    assert "goal <= 0.25" in proc.stdout


def test_ov_prefill_times_the_portable_prefill_on_each_runtime(tiny_checkpoint, tmp_path):
    """bench/ov_prefill.py on a tiny portable export: ORT CPU, OpenVINO's runtime in f32 and the OpenVINO EP each
    report a TTFT per length (the EP skipped with the reason where its plugin lists no device); OpenVINO f32 gives
    ORT's greedy tokens from the cache its prefill wrote."""
    pytest.importorskip("openvino")
    pytest.importorskip("onnxruntime_ep_openvino")
    from decodert.runtime.backends.openvino import ep

    with_ep = ep.provider() is not None
    art = tmp_path / "portable"
    export_model(tiny_checkpoint("llama"), art, max_seq=64, max_batch=1, progress=False, target="portable")
    proc = _bench_script("ov_prefill.py", str(art), "--lens", "8,24", "--repeats", "1", "--configs", "ov-f32,ep-fp32",
                         "--parity-len", "8", "--parity-gen", "5", "--work", str(tmp_path / "work"),
                         "--json", str(tmp_path / "ov.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["setting"]: r for r in json.loads((tmp_path / "ov.json").read_text())["results"]}
    assert set(rows) == {"ort-cpu", "ov-f32", *(["ep-fp32"] if with_ep else [])}
    assert with_ep or "ep-fp32: skipped (the OpenVINO EP is not installed here or its plugin lists no device" in proc.stdout + proc.stderr
    assert all(set(run["first"]) == {"8", "24"} and len(run["tokens"]) == 6 for r in rows.values() for run in r["runs"])
    assert rows["ov-f32"]["runs"][0]["tokens"] == rows["ort-cpu"]["runs"][0]["tokens"]
    assert "argmax 6/6" in rows["ov-f32"]["parity"][0]
    unknown = _bench_script("ov_prefill.py", str(art), "--configs", "ov-nonsense")
    assert unknown.returncode == 2 and "unknown setting" in unknown.stdout


@pytest.mark.parametrize("args, message", [
    (["--runtimes", "decodert,nope"], "unknown runtime 'nope'"),
    (["--max-seq", "200", "--prompt-len", "128", "--gen", "128"], "--max-seq 200 is shorter than"),
])
def test_compare_refuses_bad_runtimes_and_short_caches(args, message):
    proc = _bench_script("compare.py", *args)
    assert proc.returncode == 2 and message in proc.stderr
