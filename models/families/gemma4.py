"""Gemma 4 text (the E2B/E4B layout): Gemma 3's block with plain-w RMSNorms, attention scale 1, a weightless
RMSNorm on v, per-layer input embeddings, K/V shared by the last layers, double-wide MLPs on those layers,
a scalar on each layer's output, proportional RoPE on the full layers and a final logit soft-cap.

    config.json  model_type gemma4_text, or gemma4 (an image/audio-text checkpoint: its text_config and
                 its language-model weights; the vision tower is left out)
    audio        with an ``audio_config``: the conformer (models/audio_conformer.py, encoder kind "gemma4") and the
                 embedder into the text model; its rows replace the ``audio_token_id`` rows in prefill as image rows
                 do, whose per-layer inputs read the pad token's (transformers' Gemma4Model); features from
                 preprocessor_config.json (Gemma4AudioFeatureExtractor: runtime/audio/features_gemma4.py)

The full layers' head_dim (``global_head_dim``, 512 in the E2B/E4B) may differ from the sliding layers'
(``layer_head_dims``: each K/V layer's cache has its own last dimension). What decodert cannot run yet is
refused in one line naming it: ``attention_k_eq_v`` (and the per-layer K/V head count it brings), the MoE block
(``enable_moe_block``: the 26B-A4B's dense MLP + experts), bidirectional attention.
"""

from __future__ import annotations

import dataclasses
import math

from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.models.audio_conformer import CLIPPED, ConformerSpec
from decodert.models.common import hf_attention, hf_layers, hf_mlp, hf_rope, positive_or_none, spec_from_hf_config
from decodert.models.families import gemma3
from decodert.models.layers import LayerSpec
from decodert.models.spec import ImageTokens, ModelSpec, PerLayerInputs, RopeSpec

MODEL_TYPES = ("gemma4_text", "gemma4")
TAGS = ("audio",)  # with an audio_config

_L = "model.layers.{i}."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    **{k: v for k, v in gemma3.HF_WEIGHTS.items()},
    "layers.{i}.q": _L + "self_attn.q_proj.weight",  # a layer that reads another layer's K/V
    "embed_per_layer": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm": "model.per_layer_projection_norm.weight",
    "layers.{i}.ple_gate": _L + "per_layer_input_gate.weight",
    "layers.{i}.ple_proj": _L + "per_layer_projection.weight",
    "layers.{i}.ple_norm": _L + "post_per_layer_input_norm.weight",
    "layers.{i}.layer_scalar": _L + "layer_scalar",
}

# transformers' Gemma4TextConfig defaults: a multimodal config.json lists only what differs.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, global_head_dim=512, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, sliding_window=512, final_logit_softcapping=None, vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256, attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False,
    use_double_wide_mlp=False,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1_000_000.0}},
)
_TOWERS = ("model.vision_tower.", "model.embed_vision.")

_A = "audio_tower."
_AL = _A + "layers.{i}."
_CLIPPED_KEYS = {"ff1.fc1": "feed_forward1.ffw_layer_1", "ff1.fc2": "feed_forward1.ffw_layer_2",
                 "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
                 "attn.o": "self_attn.post", "conv.start": "lconv1d.linear_start", "conv.end": "lconv1d.linear_end",
                 "ff2.fc1": "feed_forward2.ffw_layer_1", "ff2.fc2": "feed_forward2.ffw_layer_2"}
assert set(_CLIPPED_KEYS) == set(CLIPPED)
AUDIO_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "audio.sub.conv0": _A + "subsample_conv_projection.layer0.conv.weight",
    "audio.sub.norm0": _A + "subsample_conv_projection.layer0.norm.weight",
    "audio.sub.conv1": _A + "subsample_conv_projection.layer1.conv.weight",
    "audio.sub.norm1": _A + "subsample_conv_projection.layer1.norm.weight",
    "audio.sub.proj": _A + "subsample_conv_projection.input_proj_linear.weight",
    **{f"audio.layers.{{i}}.{n}": _AL + f"{k}.linear.weight" for n, k in _CLIPPED_KEYS.items()},
    **{f"audio.layers.{{i}}.{n}_clip": tuple(_AL + f"{k}.{b}" for b in ("input_min", "input_max", "output_min",
                                                                       "output_max"))
       for n, k in _CLIPPED_KEYS.items()},
    **{f"audio.layers.{{i}}.ff{j}.{n}_norm": _AL + f"feed_forward{j}.{n}_layer_norm.weight"
       for j in (1, 2) for n in ("pre", "post")},
    "audio.layers.{i}.attn.pre_norm": _AL + "norm_pre_attn.weight",
    "audio.layers.{i}.attn.rel_k": _AL + "self_attn.relative_k_proj.weight",
    "audio.layers.{i}.attn.per_dim_scale": _AL + "self_attn.per_dim_scale",
    "audio.layers.{i}.attn.post_norm": _AL + "norm_post_attn.weight",
    "audio.layers.{i}.conv.pre_norm": _AL + "lconv1d.pre_layer_norm.weight",
    "audio.layers.{i}.conv.depthwise": _AL + "lconv1d.depthwise_conv1d.weight",
    "audio.layers.{i}.conv.norm": _AL + "lconv1d.conv_norm.weight",
    "audio.layers.{i}.out_norm": _AL + "norm_out.weight",
    "audio.out_proj": _A + "output_proj.weight",
    "audio.out_proj_bias": _A + "output_proj.bias",
    "audio.embed_proj": "embed_audio.embedding_projection.weight",
}
HF_UNUSED = (r"audio_tower\..*", r"embed_audio\..*")  # read by audio_tensor, not the text model
# transformers' Gemma4AudioConfig defaults: a config.json lists only what differs
AUDIO_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, hidden_act="silu", subsampling_conv_channels=[128, 32],
    conv_kernel_size=5, residual_weight=0.5, attention_chunk_size=12, attention_context_left=13,
    attention_context_right=0, attention_logit_cap=50.0, attention_invalid_logits_value=-1.0e9,
    use_clipped_linears=True, rms_norm_eps=1e-6, gradient_clipping=1e10, output_proj_dims=1536)
# the transcription request (no transcription API in Gemma4Processor): the clip, then this instruction, in the
# user turn (runtime/audio/transcribe.py); with a forced language its name instead of "its original language"
INSTRUCTION = "Transcribe the following speech segment in {language}."
TRANSCRIPTION = {"instruction": INSTRUCTION.format(language="its original language"), "instruction_language": INSTRUCTION}
# transformers' Gemma4AudioFeatureExtractor defaults (preprocessor_config.json lists what differs)
FEATURE_DEFAULTS: dict[str, Any] = dict(
    feature_size=128, sampling_rate=16000, frame_length_ms=20.0, hop_length_ms=10.0, min_frequency=0.0,
    max_frequency=8000.0, preemphasis=0.0, preemphasis_htk_flavor=True, fft_overdrive=False, dither=0.0,
    input_scale_factor=1.0, mel_floor=1e-3, per_bin_mean=None, per_bin_stddev=None)


def sanitize(key: str) -> str | None:
    """An image/audio-text checkpoint's language-model keys -> the text model's names, the audio tower's and its
    embedder's -> the audio table's (audio_tower.*, embed_audio.*); the vision tower dropped."""
    if key.startswith(_TOWERS):
        return None
    for new, old in (("model.language_model.", "model."), ("model.audio_tower.", _A),
                     ("model.embed_audio.", "embed_audio.")):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def audio_fix(name: str, w: np.ndarray) -> np.ndarray:
    """A clipped linear's infinite bounds (transformers' initial values) -> the float32 extremes: the same clamp."""
    if name.endswith("_clip"):
        big = np.finfo(np.float32).max
        return np.clip(w, -big, big)
    return w


def audio_from_hf(config: dict) -> ConformerSpec | None:
    """The audio tower of a gemma4 config.json with an ``audio_config`` (None without one)."""
    if config.get("model_type") != "gemma4" or not config.get("audio_config"):
        return None
    a = {**AUDIO_DEFAULTS, **config["audio_config"]}
    if a["hidden_act"] != "silu":
        raise DecodertError(f"config.json: audio_config hidden_act '{a['hidden_act']}' is not supported (silu)")
    text = _text_config(config)
    try:
        return ConformerSpec(
            num_mel_bins=4 * (int(a["subsampling_conv_channels"][0]) // 4), hidden_size=int(a["hidden_size"]),
            num_layers=int(a["num_hidden_layers"]), num_heads=int(a["num_attention_heads"]),
            conv_channels=tuple(a["subsampling_conv_channels"]), out_hidden=int(text["hidden_size"]),
            output_dims=int(a["output_proj_dims"]), conv_kernel=int(a["conv_kernel_size"]),
            chunk=int(a["attention_chunk_size"]), context_left=int(a["attention_context_left"]),
            context_right=int(a["attention_context_right"]), logit_cap=float(a["attention_logit_cap"]),
            invalid_logit=float(a["attention_invalid_logits_value"]), residual_weight=float(a["residual_weight"]),
            gradient_clipping=float(a["gradient_clipping"]), clipped_linears=bool(a["use_clipped_linears"]),
            rms_norm_eps=float(a["rms_norm_eps"]), begin_token_id=_int_or_none(config.get("boa_token_id", 256_000)),
            end_token_id=_int_or_none(config.get("eoa_token_index", 258_883)))
    except ValueError as e:
        raise DecodertError(f"config.json: audio_config: {e}") from None


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


def audio_features(preprocessor: dict, audio: ConformerSpec) -> dict[str, Any]:
    """The log-mel settings (runtime/audio/features_gemma4.py Gemma4MelSettings) of preprocessor_config.json,
    checked against the encoder; Gemma4Processor's padding (to 128 samples) and truncation (30 s) as it calls the
    extractor."""
    f = {**FEATURE_DEFAULTS, **{k: v for k, v in preprocessor.items() if k in FEATURE_DEFAULTS}}
    if float(f["dither"]):
        raise DecodertError("dither adds random noise to the features; a checkpoint with dither 0 is supported")
    rate = int(f["sampling_rate"])
    frame = int(round(rate * float(f["frame_length_ms"]) / 1000.0))
    fft = 2 ** math.ceil(math.log2(frame)) * (2 if f["fft_overdrive"] else 1)
    mels = int(f["feature_size"])
    if mels != audio.num_mel_bins:
        raise DecodertError(f"feature_size {mels} differs from the {audio.num_mel_bins} mel bins the audio tower's "
                            "subsampling projection reads (4 x (subsampling_conv_channels[0] // 4))")
    for k in ("per_bin_mean", "per_bin_stddev"):
        if f[k] is not None and len(f[k]) != mels:
            raise DecodertError(f"{k} has {len(f[k])} values for {mels} mel bins")
    return dict(sampling_rate=rate, frame_length=frame, hop_length=int(round(rate * float(f["hop_length_ms"]) / 1000.0)),
                fft_length=fft, n_mels=mels, f_min=float(f["min_frequency"]), f_max=float(f["max_frequency"]),
                mel_floor=float(f["mel_floor"]), preemphasis=float(f["preemphasis"]),
                preemphasis_htk=bool(f["preemphasis_htk_flavor"]), input_scale=float(f["input_scale_factor"]),
                per_bin_mean=None if f["per_bin_mean"] is None else [float(v) for v in f["per_bin_mean"]],
                per_bin_stddev=None if f["per_bin_stddev"] is None else [float(v) for v in f["per_bin_stddev"]],
                max_samples=480_000, sample_multiple=128)


def _text_config(config: dict) -> dict:
    if config.get("model_type") != "gemma4":
        return {**HF_DEFAULTS, **config}
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DecodertError("a gemma4 config.json needs a 'text_config' object")
    top = {k: config[k] for k in ("tie_word_embeddings",) if k in config}
    return {**HF_DEFAULTS, **text, **top}


def layer_types(config: dict) -> list[str]:
    """transformers' rule: every 6th layer full unless listed; the last layer is always full."""
    layers = hf_layers(config)
    kinds = list(config.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)])
    if any(k not in ("sliding_attention", "full_attention") for k in kinds) or len(kinds) != layers:
        raise DecodertError(f"layer_types must list sliding_attention / full_attention for {layers} layers")
    kinds[-1] = "full_attention"
    return kinds


def kv_sources(kinds: list[str], shared: int) -> tuple[int, ...]:
    """Each layer's cache: its own, or for the last ``shared`` layers the last earlier own-cache layer of its
    kind (transformers' kv_sharing_modes: the "store" layer a "reuse" layer reads)."""
    first = len(kinds) - shared
    if shared <= 0:
        return ()
    if first <= 0 or set(kinds[first:]) - set(kinds[:first]):
        raise DecodertError(f"num_kv_shared_layers {shared}: every layer kind that shares K/V needs an earlier "
                            "layer of its kind that keeps a cache")
    last = {k: i for i, k in enumerate(kinds[:first])}
    return tuple(i if i < first else last[kinds[i]] for i in range(len(kinds)))


def layer_head_dims(config: dict, kinds: list[str]) -> tuple[int, ...]:
    """Each layer's head_dim: transformers' per_layer_config as saved (only what differs), else global_head_dim
    on the full layers. Another K/V head count on some layers (only with attention_k_eq_v) is refused."""
    head_dim, kv_heads = int(config["head_dim"]), int(config["num_key_value_heads"])
    per_layer = config.get("per_layer_config")
    dims = []
    for i, kind in enumerate(kinds):
        if isinstance(per_layer, dict):
            override = per_layer.get(str(i), per_layer.get(i)) or {}
        else:
            override = {"head_dim": config.get("global_head_dim")} if kind == "full_attention" else {}
        h = int(override.get("num_key_value_heads") or kv_heads)
        if h != kv_heads:
            raise DecodertError(f"layer {i} ({kind}) has {h} K/V heads where the others have {kv_heads}: "
                                "a per-layer K/V head count is not supported")
        dims.append(int(override.get("head_dim") or head_dim))
    return tuple(dims)


def ropes(config: dict) -> tuple[RopeSpec, RopeSpec]:
    """(full layers' RoPE, sliding layers' RoPE); "proportional" turns the first partial_rotary_factor of the
    angles over the whole head (transformers' _compute_proportional_rope_parameters)."""
    params = config.get("rope_parameters") or {}
    ropes = []
    for kind in ("full_attention", "sliding_attention"):
        p = dict(params.get(kind) or {})
        if p.get("rope_type") == "proportional":
            ropes.append(RopeSpec(theta=float(p.get("rope_theta", 10_000.0)), scaling="proportional",
                                  factor=float(p.get("factor", 1.0)),
                                  proportion=float(p.get("partial_rotary_factor", 1.0))))
        else:
            if p.get("partial_rotary_factor", 1.0) != 1.0:
                raise DecodertError(f"{kind}: partial_rotary_factor with rope_type {p.get('rope_type')!r} "
                                    "is not supported for gemma4")
            ropes.append(hf_rope({"rope_parameters": p}))
    return ropes[0], ropes[1]


def _refuse(config: dict) -> None:
    for key, what in (("enable_moe_block", "the MoE block (enable_moe_block)"),
                      ("attention_k_eq_v", "attention_k_eq_v (values from the key projection)"),
                      ("attention_bias", "attention_bias")):
        if config.get(key):
            raise DecodertError(f"gemma4: {what} is not supported")
    if config.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": only image tokens, none in text
        raise DecodertError(f"gemma4: use_bidirectional_attention {config['use_bidirectional_attention']!r} is not "
                            "supported (decodert is causal)")
    act = config.get("hidden_activation")
    if act not in gemma3.GELU_TANH:
        raise DecodertError(f"hidden_activation '{act}' is not supported for gemma4 (only gelu_pytorch_tanh)")


def spec_from_hf(config: dict) -> ModelSpec:
    audio = config if config.get("model_type") == "gemma4" and config.get("audio_config") else None
    config = _text_config(config)
    _refuse(config)
    kinds = layer_types(config)
    dims = layer_head_dims(config, kinds)
    full, local = ropes(config)
    sources = kv_sources(kinds, int(config.get("num_kv_shared_layers") or 0))
    double = bool(config.get("use_double_wide_mlp")) and bool(sources)
    per_layer = int(config.get("hidden_size_per_layer_input") or 0)
    window = config.get("sliding_window")
    if not window and "sliding_attention" in kinds:
        raise DecodertError("sliding layers need a sliding_window")
    attention = hf_attention(config, qk_norm=True, v_norm=True, scale=1.0)
    mlp = hf_mlp(config, activation="gelu_tanh")
    wide = dataclasses.replace(mlp, size=2 * mlp.size)

    def layer(i: int) -> LayerSpec:
        a = dataclasses.replace(attention, head_dim=dims[i], kv_source=sources[i] if sources and sources[i] != i else None)
        if kinds[i] != "full_attention":
            a = dataclasses.replace(a, window=int(window) if window else None, rope_table="rope_local")
        return LayerSpec(a, wide if double and sources[i] != i else mlp)

    spec = spec_from_hf_config(
        "gemma4", config, layer, check_activation=False, sandwich_norm=True,
        embed_scale=float(config["hidden_size"]) ** 0.5, rope=full, local_rope=local,
        final_softcap=positive_or_none(config.get("final_logit_softcapping")),
        per_layer_inputs=PerLayerInputs(per_layer, int(config.get("vocab_size_per_layer_input") or 0), "gelu_tanh")
        if per_layer else None,
        layer_scalar=True,
    )
    if audio is not None:  # the audio rows: placed as image rows, their per-layer inputs the pad token's
        token = audio.get("audio_token_id", 258_881)
        if not isinstance(token, int):
            raise DecodertError("config.json: a gemma4 model with an audio_config needs an integer 'audio_token_id'")
        spec = dataclasses.replace(spec, images=ImageTokens(token, per_layer_token=int(config.get("pad_token_id") or 0)))
    return spec
