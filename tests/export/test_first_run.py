"""First-run defects (issue 17) below the CLI: what `run` exports from a GGUF (its own precision),
export progress on stderr, --keep-q4-1 refused off the ort target."""

import io
import subprocess
import sys

import pytest

from tiny import make_tiny_gguf  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export import progress  # noqa: E402
from decodert.export.checkpoints.checkpoint_open import open_checkpoint  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.export.quantize.quant import QuantConfig  # noqa: E402
from decodert.export.checkpoints.source_precision import keep_precision  # noqa: E402


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prec")
    return {q: make_tiny_gguf("llama", folder / f"{q}.gguf", q) for q in ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")}


@pytest.mark.parametrize("qtype, bits, exact", [("F32", None, None), ("F16", None, None), ("Q4_0", 4, "transcoded"),
                                                ("Q4_1", None, None), ("Q8_0", 8, "transcoded")])
def test_run_keeps_the_gguf_precision(ggufs, tmp_path, qtype, bits, exact):
    quant, what = keep_precision(open_checkpoint(ggufs[qtype]))
    assert (quant and quant.bits) == bits and (what.startswith("fp32") if bits is None else qtype in what)
    if quant is None:
        return
    assert quant.accuracy_level == 4  # the fast MatMulNBits kernels
    m = export_model(ggufs[qtype], tmp_path / "a", max_seq=32, max_batch=1, progress=False, quant=quant)
    layers = {n: w for n, w in m.quant.per_weight.items() if n != "lm_head"}
    assert layers and all(w.source == exact for w in layers.values())  # every linear layer kept exact


def test_hf_folder_stays_fp32(tiny_checkpoint):
    assert keep_precision(open_checkpoint(tiny_checkpoint("llama")))[0] is None


def test_smollm2_q4_1_runs_in_fp32(smollm2_gguf):
    # int4 at accuracy level 4 turned "What is the capital of France?" into a wrong answer (issue 17)
    quant, what = keep_precision(open_checkpoint(smollm2_gguf))
    assert quant is None and what.startswith("fp32") and "Q4_1" in what


def test_keep_q4_1_refused_off_the_ort_target(ggufs, tmp_path):
    for target in ("trt", "portable"):
        with pytest.raises(DecodertError, match="--keep-q4-1 works on the ort target only"):
            export_model(ggufs["Q4_1"], tmp_path / "t", target=target, quant=QuantConfig(keep_q4_1=True))
    res = subprocess.run([sys.executable, "-m", "decodert", "export", str(ggufs["Q4_1"]), "-o", str(tmp_path / "c"),
                          "--target", "trt", "--quant", "int4", "--keep-q4-1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--keep-q4-1 works on the ort target" in res.stderr
    assert not (tmp_path / "c").exists()


# -- progress ---------------------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_stage_lines_when_not_a_terminal():
    out = io.StringIO()
    with progress.Stage("quantizing", total=3, unit="tensor", delay_s=0, every_s=0, stream=out) as bar:
        for _ in range(3):
            bar.update()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("decodert: quantizing: 1/3 tensor") and lines[-1].endswith("s done") and len(lines) == 4
    quiet = io.StringIO()
    with progress.Stage("fast", total=3, stream=quiet) as bar:  # shorter than DELAY_S: nothing
        bar.update(3)
    failed = io.StringIO()
    with pytest.raises(ValueError), progress.Stage("x", total=2, delay_s=0, every_s=99, stream=failed) as bar:
        bar.update()
        raise ValueError
    assert quiet.getvalue() == "" and "done" not in failed.getvalue() and failed.getvalue().count("\n") == 1
    off = io.StringIO()
    with progress.Stage("off", total=2, enabled=False, delay_s=0, stream=off) as bar:
        bar.update(2)
    assert off.getvalue() == ""


def test_stage_draws_a_bar_on_a_terminal():
    tty = _Tty()
    with progress.Stage("writing", total=2, unit="step", delay_s=0, stream=tty) as bar:
        bar.update(2)
    assert "writing" in tty.getvalue() and "2/2" in tty.getvalue()


def test_export_reports_each_stage(ggufs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    export_model(ggufs["Q4_1"], tmp_path / "a", max_seq=32, max_batch=1, quant=QuantConfig(bits=4))
    err = capsys.readouterr().err
    for stage in ("reading Q4_1.gguf", "quantizing weights to int4 (scale search)", "writing graphs and manifest"):
        assert f"decodert: {stage}: " in err, err
    export_model(ggufs["F32"], tmp_path / "b", max_seq=32, max_batch=1, progress=False)
    assert capsys.readouterr().err == ""
