"""bench/train_eagle3.py (the EAGLE-3 head trained here for SmolLM2) and bench/eagle3_speed.py's argument
handling, on tiny random checkpoints: the aux features are the inputs of the named layers, the
training-time-test forward is the step-by-step inference the docstring describes (an independent per-position
reference with its own cache), the draft vocabulary maps both ways, and a one-epoch run writes the published
folder layout."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import eagle3_speed  # noqa: E402
import train_eagle3 as T  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

CFG = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
       "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def _random_head(seed: int, vocab: int = 40, draft: int = 24):
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, CFG["hidden_size"], generator=g)
    keep = torch.randperm(vocab, generator=g)[:draft].sort().values
    head = T.make_head(CFG, embed, torch.ones(CFG["hidden_size"]), keep)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if p.ndim == 1 else 0.0))
    return head, embed, keep, g


def _reference_steps(head, embed, feats, ids, n: int, steps: int):
    """Inference as the docstring says, one pair at a time with an explicit K/V list: catch up on the
    pairs (F_t, x_{t+1}) at positions 0..n, then chain steps k = 1.. with (h, x_{n+1+k}) at n + k."""
    H, nh, nkv, hd = CFG["hidden_size"], CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]
    mid = head.midlayer
    at = mid.self_attn
    rows = {k: v.detach().double() for k, v in head.state_dict().items()}

    def norm(x, w):
        return rows[w] * x / torch.sqrt((x * x).mean() + CFG["rms_norm_eps"])

    def rot(x, pos):  # x [heads, hd]: pair i with i + hd/2
        out = torch.empty_like(x)
        for i in range(hd // 2):
            ang = pos / CFG["rope_theta"] ** (2 * i / hd)
            c, s = math.cos(ang), math.sin(ang)
            out[:, i] = x[:, i] * c - x[:, i + hd // 2] * s
            out[:, i + hd // 2] = x[:, i + hd // 2] * c + x[:, i] * s
        return out

    cache_k, cache_v = [], []

    def one(g, token, pos):
        e = embed[token].double()
        a = torch.cat([norm(e, "midlayer.input_layernorm.weight"), norm(g, "midlayer.hidden_norm.weight")])
        q = rot((rows["midlayer.self_attn.q_proj.weight"] @ a).view(nh, hd), pos)
        cache_k.append(rot((rows["midlayer.self_attn.k_proj.weight"] @ a).view(nkv, hd), pos))
        cache_v.append((rows["midlayer.self_attn.v_proj.weight"] @ a).view(nkv, hd))
        o = torch.empty(nh, hd, dtype=torch.float64)
        for j in range(nh):
            kv = j // (nh // nkv)
            sc = torch.stack([k[kv] @ q[j] for k in cache_k]) / math.sqrt(hd)
            o[j] = torch.softmax(sc, 0) @ torch.stack([v[kv] for v in cache_v])
        r = g + rows["midlayer.self_attn.o_proj.weight"] @ o.reshape(-1)
        x = norm(r, "midlayer.post_attention_layernorm.weight")
        gate, up = rows["midlayer.mlp.gate_proj.weight"] @ x, rows["midlayer.mlp.up_proj.weight"] @ x
        h = r + rows["midlayer.mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up)
        return h, rows["lm_head.weight"] @ norm(h, "norm.weight")

    del mid, at, H
    for t in range(n + 1):
        h, logits = one(rows["fc.weight"] @ feats[t].double(), int(ids[t + 1]), t)
    out = [logits]
    for k in range(1, steps):
        h, logits = one(h, int(ids[n + 1 + k]), n + k)
        out.append(logits)
    return out


def test_ttt_forward_is_step_by_step_inference():
    """Step k at index n of the training-time test = the k-th chained draft after catching up to n."""
    head, embed, _, g = _random_head(3)
    B, Tn, steps = 2, 9, 3
    feats = torch.randn(B, Tn, 3 * CFG["hidden_size"], generator=g)
    ids = torch.randint(0, embed.shape[0], (B, Tn + steps), generator=g)
    with torch.no_grad():
        logits = T.ttt_forward(head, CFG, embed, feats, ids[:, :Tn], steps)
    for b in range(B):
        for n in (0, 3, Tn - 1 - steps):
            ref = _reference_steps(head, embed, feats[b], ids[b], n, steps)
            for k in range(steps):
                torch.testing.assert_close(logits[k][b, n].double(), ref[k], atol=1e-4, rtol=1e-4)


def test_aux_features_are_the_inputs_of_the_named_layers(tmp_path):
    """features[t] = [input of layer i at t for i in ids]; next = the target's greedy token at t."""
    folder = make_tiny_checkpoint("llama", tmp_path / "tiny", num_hidden_layers=4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    seen = {}
    def keep(i):
        return lambda module, args, kwargs: seen.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None))

    hooks = [model.model.layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in (1, 2, 3)]
    g = torch.Generator().manual_seed(5)
    prompt, answer = torch.randint(3, 500, (6,), generator=g).tolist(), torch.randint(3, 500, (5,), generator=g).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0]
    for h in hooks:
        h.remove()
    f = T.collect_features(folder, [{"ids": prompt, "answer": answer}], [1, 2, 3])[0]
    want = torch.cat([seen[i][0] for i in (1, 2, 3)], dim=-1)
    torch.testing.assert_close(f["feats"].float(), want, atol=2e-2, rtol=2e-3)  # stored as float16
    assert f["next"].tolist() == logits.argmax(-1).tolist()
    assert f["mask"].tolist() == [False] * 5 + [True] * 6  # from the last prompt position on


def test_draft_vocabulary_maps_both_ways():
    nxt = torch.tensor([5, 5, 5, 9, 9, 1, 7, 7, 7, 7, 3])
    feats = [{"next": nxt, "mask": torch.ones(len(nxt), dtype=torch.bool)}]
    keep, d2t, t2d, coverage = T.draft_vocab(feats, 3, 12)
    assert keep.tolist() == [5, 7, 9]  # the three most frequent, sorted by id
    assert (torch.arange(3) + d2t).tolist() == keep.tolist() and d2t.dtype == torch.int64
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [5, 7, 9]
    assert coverage == pytest.approx(9 / 11)


def test_one_epoch_run_writes_the_published_layout(tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("DECODERT_THREADS", "1")
    threads = torch.get_num_threads()

    folder = make_tiny_checkpoint("llama", tmp_path / "tiny", num_hidden_layers=8, tie_word_embeddings=True)
    out = tmp_path / "head"
    assert T.main(["--gguf", str(folder), "--hf", str(folder), "--work", str(tmp_path / "work"), "--out", str(out),
                   "--prompts", "6", "--gen", "6", "--generator", "fp32", "--epochs", "1", "--ttt", "2",
                   "--draft-vocab", "64", "--threads", "1"]) == 0
    torch.set_num_threads(threads)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (64, 4, 2, 16)
    D, H = cfg["draft_vocab_size"], 64
    assert D <= 64 and cfg["vocab_size"] == 512
    w = load_file(str(out / "model.safetensors"))
    shapes = {k: list(v.shape) for k, v in w.items()}
    assert shapes == {
        "fc.weight": [H, 3 * H], "midlayer.input_layernorm.weight": [H], "midlayer.hidden_norm.weight": [H],
        "midlayer.self_attn.q_proj.weight": [64, 2 * H], "midlayer.self_attn.k_proj.weight": [32, 2 * H],
        "midlayer.self_attn.v_proj.weight": [32, 2 * H], "midlayer.self_attn.o_proj.weight": [H, 64],
        "midlayer.post_attention_layernorm.weight": [H], "midlayer.mlp.gate_proj.weight": [128, H],
        "midlayer.mlp.up_proj.weight": [128, H], "midlayer.mlp.down_proj.weight": [H, 128], "norm.weight": [H],
        "lm_head.weight": [D, H], "d2t": [D], "t2d": [512]}
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    targets = torch.arange(D) + w["d2t"]
    assert w["t2d"].nonzero().flatten().tolist() == targets.tolist()
    info = json.loads((out / "training.json").read_text())
    assert len(info["free"]["step_acc"]) == 2 and info["free_rows"] == len(T.HELD_OUT)
    assert len(info["free2"]["step_acc"]) == 2 and info["free2_rows"] == len(T.HELD_OUT_2)
    assert "estimated speed-up" in capsys.readouterr().out
    # --init goes on training that head on more data, keeping its draft vocabulary; another size is refused
    common = ["--gguf", str(folder), "--hf", str(folder), "--work", str(tmp_path / "work"), "--prompts", "8", "--gen", "6",
              "--generator", "fp32", "--epochs", "1", "--ttt", "2", "--threads", "1", "--init", str(out)]
    assert T.main(common + ["--out", str(tmp_path / "again"), "--draft-vocab", "64"]) == 0
    torch.set_num_threads(threads)
    assert "going on from" in capsys.readouterr().out
    assert json.loads((tmp_path / "again" / "training.json").read_text())["init"] == str(out)
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert torch.equal(again["d2t"], w["d2t"]) and torch.equal(again["t2d"], w["t2d"])
    with pytest.raises(SystemExit, match="its draft vocabulary has another size"):
        T.main(common + ["--out", str(tmp_path / "other"), "--draft-vocab", "16"])
    torch.set_num_threads(threads)


def test_speed_script_refuses_bad_arguments(tmp_path, capsys):
    target, head = tmp_path / "t", tmp_path / "h"
    for argv, msg in (([], "required"),
                      (["--target", str(target), "--head", str(head)], "does not exist"),
                      (["--target", str(target), "--head", str(head), "--gguf", str(tmp_path / "x.gguf")], "x.gguf does not exist"),
                      (["--target", str(target), "--head", str(head), "--modes", "plain,medusa"], "unknown medusa"),
                      (["--target", str(target), "--head", str(head), "--modes", "eagle3"], "must include plain"),
                      (["--target", str(target), "--head", str(head), "--repeats", "0"], "--repeats must be at least 1"),
                      (["--target", str(target), "--head", str(head), "--prompt-set", "mine"], "invalid choice: 'mine'"),
                      (["--target", str(target), "--head", str(head), "--prompts", "0"], "--prompts must be at least 1")):
        with pytest.raises(SystemExit) as e:
            eagle3_speed.parse(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_speed_report_flags_different_tokens():
    plain = [[{"tokens": [1, 2, 3, 4, 5], "decode_s": 1.0, "accepted_per_step": None, "acceptance_rate": None}]]
    fast = [[{"tokens": [1, 2, 3, 4, 5], "decode_s": 0.5, "accepted_per_step": 2.0, "acceptance_rate": 0.5}]]
    wrong = [[{"tokens": [1, 2, 3, 9, 5], "decode_s": 0.5, "accepted_per_step": 2.0, "acceptance_rate": 0.5}]]
    table, same = eagle3_speed.report({"plain": plain, "eagle3": fast})
    assert same and "2.00" in table.splitlines()[2]
    table, same = eagle3_speed.report({"plain": plain, "eagle3": wrong})
    assert not same and table.splitlines()[2].endswith("NO")
