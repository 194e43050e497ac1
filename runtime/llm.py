"""`LLM`: load an exported artifact folder and generate, stream, chat or batch requests.

    llm = LLM.load("out/smollm2")                      # backend "auto" | "ort" | "trt"
    llm.generate("Hello", max_new_tokens=32).text
    for delta in llm.stream("Hello", temperature=0.7, seed=1): print(delta, end="")
    llm.chat([{"role": "user", "content": "Hi"}])
    llm.chat([{"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What?"}]}])
    llm.generate_many([Request("a"), Request("b", SamplingParams(max_new_tokens=8))])
    llm.generate("A person as JSON:", json_schema={...})  # or regex=..., grammar=... (Lark): docs/STRUCTURED.md
    llm = LLM.load("out/lora", adapters={"sql": "adapters/sql"}); llm.generate("Hi", adapter="sql")  # LoRA per call
    chat = llm.session(system="Be brief."); chat.chat("Hi"); chat.chat("And then?")   # runtime/chat/session.py
    chat.save("hi.session"); chat = llm.resume("hi.session")   # the conversation and its K/V on disk
    llm.warm([[{"role": "system", "content": "..."}]])    # prefilled into the prefix cache (runtime/warm.py)
    llm.embed(["a text", "another"], dimensions=None)  # unit vectors [n, d] from embed.onnx (runtime/embedding.py)

Every run goes through the LLM's engine (runtime/engine/): ``prepare`` builds the request, the engine runs
it. One cache of ``backend.max_batch`` slots is allocated on first use and reused; an LLM object
runs one generation at a time (runtime/engine/runs.py). Starting one ends an unfinished stream of the same thread. From
several threads, runs serialise: a call waits while another thread's generation or open stream
holds the cache (``busy_timeout`` seconds at most, then DecodertError; default: no limit); a
stream left open by a thread that has exited no longer counts (the next run ends it). A
KeyboardInterrupt inside a step ends that run only: its slots are freed and the next call works.

Prompts that start like an earlier one reuse its K/V (runtime/prefix_cache.py): ``prefix_cache_mb``
bounds that cache (default: room for two full contexts, at most a quarter of the free memory;
0 = off), and ``result.metrics.cached_tokens`` says how many prompt tokens were not prefilled.
``cache_dir`` keeps its blocks on disk too (runtime/persist/disk_tier.py, ``cache_dir_gb`` GB at most), so a
new process on the same artifact and folder starts with them.

Opening the folder (manifest, tokenizer, backend choice, prefix-cache budget) is runtime/backends/loading.py.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence as Seq, Union

import numpy as np

from decodert.errors import Busy, DecodertError, RequestError
from decodert.artifact.heads import HEAD_MANIFEST, load_head
from decodert.artifact.manifest import MANIFEST, Manifest, TokenizerRecord, tokenizer_file
from decodert.runtime import validate
from decodert.runtime.adapters import Adapters
from decodert.runtime.chat.harmony import markup_decoder
from decodert.runtime.chat.chat import Message, render_chat
from decodert.runtime.chat.tool_calls import tool_format
from decodert.runtime.chat.turn import ChatStream, ChatTurn, chat_turn, pop_options
from decodert.runtime.constraints import Constraint, Guidance
from decodert.runtime.decoding.generate import GenerationResult, Sequence, TextStream
from decodert.runtime.backends.loading import (  # noqa: F401  (open_tokenizer, read_manifest: re-exported)
    make_prefix_cache, model_defaults, open_backend, open_tokenizer, read_manifest)
from decodert.runtime.decoding.sampling import SamplingParams, sampling_params
from decodert.runtime.engine.engine import Engine
from decodert.runtime.engine.request import Prepared
from decodert.runtime.engine.runs import Runs
from decodert.runtime.embedding import EmbedInput, Embedder
from decodert.runtime.speculation.speculative import Speculator
from decodert.runtime.audio.clips import DEFAULT_AUDIO_LIMITS, load_audio
from decodert.runtime.audio.encoder import Audio
from decodert.runtime.audio.messages import has_audio, split_audio
from decodert.runtime.audio.transcribe import parse_transcription, transcription_messages
from decodert.runtime.audio.whisper import WhisperLLM
from decodert.artifact.seq2seq import is_seq2seq_artifact
from decodert.runtime.vision.encoder import Vision
from decodert.runtime.vision.images import DEFAULT_LIMITS
from decodert.runtime.vision.messages import split_images
from decodert.runtime.vision.video import Video
from decodert.runtime.warm import warm as warm_prompts

if TYPE_CHECKING:
    from decodert.runtime.chat.session import Session

Prompt = Union[str, Seq[int], np.ndarray]  # text, or token ids used as they are
CONSTRAINT_ARGS = ("json_schema", "regex", "grammar")  # structured-output keyword arguments (runtime/constraints.py)


@dataclass
class Request:
    """One request for ``LLM.generate_many``: a prompt (or chat messages) and its own parameters."""

    prompt: Prompt | None = None
    params: SamplingParams | None = None  # None: the model's sampling defaults; an object is used as it is
    messages: Seq[Message] | None = None  # chat messages instead of a prompt
    constraint: Constraint | None = None  # structured output: Constraint.of(json_schema=... | regex=... | grammar=...)
    speculative: Any = None  # "ngram" | "draft" | SpeculativeConfig (runtime/speculation/speculative.py)
    adapter: str | None = None  # a LoRA adapter loaded by name (LLM.load(adapters=...)); None: the base model


class LLM:
    """A backend (runtime/backends/backend.py), a ``tokenizers.Tokenizer`` and the artifact manifest.

    Generation keyword arguments are the SamplingParams fields: max_new_tokens=256,
    temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
    seed=None, stop=(), stop_token_ids=(), logit_bias={id: bias}, logprobs=False, top_logprobs=0
    (``result.logprobs``: one TokenLogprob per generated token). A parameter you do not pass takes the model's
    default (``sampling_defaults``: manifest.sampling, export/checkpoints/sampling_defaults.py; e.g.
    SmolLM2-Instruct: temperature 0.2, top_p 0.5), else SamplingParams' (greedy). Explicit
    arguments always override, one parameter at a time: ``temperature=0`` is greedy.
    Structured output: at most one of json_schema= (dict or JSON text), regex=, grammar= (Lark);
    the output then matches it, unless cut short by max_new_tokens (finish_reason "length").
    """

    def __init__(self, backend: Any, tokenizer: Any, manifest: Manifest | None = None,
                 draft: "LLM | None" = None, prefix_cache_mb: float | None = None, tool_parser: str | None = None,
                 cache_dir: str | Path | None = None, cache_dir_gb: float | None = None, source: str | None = None,
                 head: Any = None) -> None:
        self.tool_parser = tool_parser  # tool-call format (runtime/chat/tool_calls.py); None: from the template
        self.draft = draft  # the draft model of speculative="draft"
        self.tokenizer = tokenizer
        self.manifest = manifest
        tok = manifest.tokenizer if manifest else TokenizerRecord()
        model_eos, model_bos = (manifest.model.eos_token_ids, manifest.model.bos_token_id) if manifest else ((), None)
        self.bos_token_id = tok.bos_token_id if tok.bos_token_id is not None else model_bos
        self.add_bos_token = tok.add_bos_token
        self.chat_template = tok.chat_template
        self.sampling_defaults = model_defaults(manifest)
        self._guidance: Guidance | None = None  # llguidance tokenizer, made on the first constrained request
        self._guidance_lock = threading.Lock()  # not the runs' lock: building it must not hold up a running step
        self._sessions: weakref.WeakSet = weakref.WeakSet()  # closed with the LLM
        self._embedder: Embedder | None = None  # made by the first embed call
        self._embedder_lock = threading.Lock()
        self.image_limits = DEFAULT_LIMITS  # bytes, pixels and images per request (the server sets its own)
        self.fetch_image: Callable[[str, str], bytes] | None = None  # remote image URLs: refused unless set
        layout = manifest.lora_layout if manifest else None  # LoRA slots: adapters by name (runtime/adapters.py)
        self.adapters = Adapters(layout, manifest.model.spec() if manifest and layout else None,
                                 getattr(backend, "lora_weights", None))
        self.audio_limits = DEFAULT_AUDIO_LIMITS  # bytes, seconds and clips per request (runtime/audio/clips.py)
        vision = Vision.attach(backend, manifest)  # images in (runtime/vision/); None: text only
        audio = Audio.attach(backend, manifest)  # audio in (runtime/audio/), its rows in the same store; None: none
        if audio is not None:
            audio.placeholder = tokenizer.id_to_token(audio.token_id) or audio.placeholder
            audio.wrap = tuple("" if t is None else tokenizer.id_to_token(t) or "" for t in audio.wrap_ids)
        prefix = make_prefix_cache(backend, prefix_cache_mb, cache_dir, cache_dir_gb, manifest, source)  # None: off
        if prefix is not None:
            prefix.adapter_key = self.adapters.key_of  # the disk tier keys adapter rows by the adapter's content
        self.engine = Engine(backend, decoder=markup_decoder(tokenizer, self.chat_template),  # harmony keeps its markup
                             eos_token_ids=tuple(tok.eos_token_ids or model_eos),
                             prefix_cache=prefix,
                             speculator=Speculator(draft.backend if draft is not None else None, head),
                             vision=vision, audio=audio,
                             adapters=self.adapters, guidance=lambda: self.guidance, manifest=manifest)
        self.runs = Runs(self.engine)  # callers' runs take the engine one at a time

    # -- what the engine owns, seen from here ------------------------------------------------------
    @property
    def backend(self) -> Any:
        return self.engine.backend

    @backend.setter
    def backend(self, backend: Any) -> None:
        self.engine.backend = backend

    @property
    def prefix_cache(self) -> Any:
        return self.engine.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, prefix: Any) -> None:
        self.engine.prefix_cache = prefix

    @property
    def vision(self) -> Any:
        return self.engine.vision

    @property
    def audio(self) -> Any:
        return self.engine.audio

    @property
    def speculator(self) -> Speculator:
        return self.engine.speculator

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Seq[int]) -> None:
        self.engine.eos_token_ids = tuple(ids)

    @property
    def busy_timeout(self) -> float | None:
        """Seconds a run waits for another thread's open stream (None: as long as it takes)."""
        return self.runs.busy_timeout

    @busy_timeout.setter
    def busy_timeout(self, seconds: float | None) -> None:
        self.runs.busy_timeout = seconds

    @classmethod
    def load(cls, path: str | Path, backend: str = "auto", verify: str = "fast",
             draft: str | Path | None = None, prefix_cache_mb: float | None = None,
             tool_parser: str | None = None, adapters: Mapping[str, str | Path] | None = None, *,
             cache_dir: str | Path | None = None, cache_dir_gb: float | None = None,
             placement: Any = "auto") -> "LLM":
        """Open an artifact folder written by ``decodert export`` (and maybe ``decodert build``).

        A checkpoint ("smollm2", a .gguf file, an HF folder) is exported first by the façade above
        export and runtime, ``decodert.LLM`` (api.py), whose ``load`` then calls this one.
        ``verify``: "fast" (sizes + sha256 of each file's first and last MiB), "full" (the whole
        sha256 of every file, as ``--full-verify``) or "none"; a mismatch names the file.
        ``draft``: a second model with the same tokenizer, the drafter of ``speculative="draft"`` (opened
        by ``cls.load``: through the façade, it may be a checkpoint too); or a draft head's artifact (head.json:
        ``decodert export HEAD --target-artifact``), the drafter of ``speculative="assistant"`` or ``"mtp"`` (a Qwen3.5
        MTP head), as its record says (and of "auto").
        ``prefix_cache_mb``: the prefix cache's budget in MiB (None: the default; 0: off).
        ``tool_parser``: the tool-call format ("hermes" | "llama3" | "mistral" | "phi4"; None: the template's).
        ``adapters``: LoRA adapters by name -> PEFT folder, for an artifact exported with ``--lora-slots``;
        ``adapter="name"`` then picks one per call or request (``load_adapter`` / ``unload_adapter`` later).
        ``cache_dir``: a folder where the prefix cache also keeps its blocks (runtime/persist/disk_tier.py), read
        back by later processes on the same artifact; ``cache_dir_gb``: the most it holds there (default 4 GB).
        ``placement``: which backend runs each phase on ONNX Runtime ("auto": the fastest measured here, cached
        beside the artifact; "measure"; "off" / "ort": today's one session; or ``{"prefill": "openvino", ...}``;
        runtime/backends/placement.py, docs/features/placement.md).
        """
        path = Path(path)
        if is_seq2seq_artifact(path):  # an encoder-decoder export (Whisper): its own runtime (runtime/audio/whisper.py)
            return WhisperLLM(path, verify, backend=backend)  # type: ignore[return-value]
        if not (path / MANIFEST).is_file():
            raise DecodertError(f"{path}: not an artifact folder (no {MANIFEST}); runtime's LLM.load opens exports only, "
                                "decodert.LLM.load (decodert/api.py) also takes 'smollm2', a .gguf file or an HF folder")
        manifest = read_manifest(path, verify)
        tokenizer_file(manifest, path)  # the tokenizer must be one of the verified files
        tokenizer = open_tokenizer(path, manifest)  # cheap checks before the backend loads weights
        drafter = head = None
        if draft is not None and (Path(draft) / HEAD_MANIFEST).is_file():
            record = load_head(draft, manifest)  # refuses a head exported for another target
            placement = "off"  # the head reads every pass's hidden state, which the ort sessions return
        elif draft is not None:
            drafter = cls.load(draft, backend, verify, prefix_cache_mb=0, placement="off")
            if drafter.tokenizer.get_vocab(with_added_tokens=True) != tokenizer.get_vocab(with_added_tokens=True):
                raise DecodertError(f"draft model {draft} has another tokenizer than {path}; "
                                    "speculative decoding needs the same vocabulary")
        if tool_parser is not None:
            tool_format(None, tool_parser)  # an unknown name fails before the weights load
        opened = open_backend(path, manifest, backend, placement)
        if draft is not None and drafter is None:
            from decodert.runtime.speculation.heads import head_drafter

            head = head_drafter(opened, draft, record)
        llm = cls(opened, tokenizer, manifest, drafter, prefix_cache_mb, tool_parser, cache_dir, cache_dir_gb,
                  str(path.resolve()), head)
        if adapters is not None and not isinstance(adapters, Mapping):
            raise DecodertError(f"adapters must map names to PEFT adapter folders, got {type(adapters).__name__}")
        for name, folder in (adapters or {}).items():
            llm.load_adapter(name, folder)
        return llm

    def load_adapter(self, name: str, folder: str | Path) -> None:
        """Load a PEFT LoRA folder into a free adapter slot as ``name`` (no re-export; the same name is replaced,
        when no generation is running: its rows would change adapter mid-answer)."""
        with self.runs.lock:
            if self.runs.busy and name in self.adapters.names:
                raise DecodertError(f"adapter {name!r} is loaded and a run is in progress; replace it when no "
                                    "generation is running, or load it under another name")
            self.adapters.load(name, folder)

    def unload_adapter(self, name: str) -> None:
        """Free ``name``'s slot; K/V computed under it are never reused (their tag is not loaded again)."""
        with self.runs.lock:
            if self.runs.busy:
                raise DecodertError(f"adapter {name!r}: a run is in progress; unload it when no generation is running")
            self.adapters.unload(name)

    def params(self, **params: Any) -> SamplingParams:
        """Validated SamplingParams: ``params`` over the model's ``sampling_defaults``."""
        return sampling_params(**{**self.sampling_defaults, **params})

    def split_params(self, params: Mapping[str, Any]) -> tuple[SamplingParams, Constraint | None]:
        """Generation keyword arguments -> (``self.params(...)``, the json_schema / regex / grammar constraint or None)."""
        rest = dict(params)
        constraint = Constraint.of(**{k: rest.pop(k) for k in CONSTRAINT_ARGS if k in rest})
        return self.params(**rest), constraint

    @property
    def slots_in_use(self) -> int:
        """Cache slots held by the current run (0 whenever no run is in progress)."""
        return self.engine.slots_in_use

    def close(self) -> None:
        """Release the backend's resources (GPU memory for trt) when it has a ``close``."""
        close = getattr(self.backend, "close", None)
        with self.runs.lock:
            self.runs.end()
            self.engine.release_cache()
            for session in list(self._sessions):
                session.close()
            if self.prefix_cache is not None:
                getattr(self.prefix_cache, "close", self.prefix_cache.clear)()  # the disk tier writes what is queued
        if close is not None:
            close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts -------------------------------------------------------------------------
    @property
    def max_seq(self) -> int:
        return int(self.backend.max_seq)

    def encode(self, prompt: Prompt, add_bos: bool | None = None, what: str = "prompt") -> np.ndarray:
        """Prompt text (or ids) -> ids [L] int64; adds BOS as the manifest says (add_bos_token).
        Types are checked first (runtime/validate.py): DecodertError naming ``what``."""
        prompt = validate.check_prompt(prompt, what)
        if isinstance(prompt, str):
            ids = validate.encode_text(self.tokenizer, prompt, self.max_seq, what)
            add_bos = self.add_bos_token if add_bos is None else add_bos
            if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids.insert(0, int(self.bos_token_id))
            return np.asarray(ids, dtype=np.int64)
        return prompt

    def apply_chat_template(self, messages: Seq[Message], add_generation_prompt: bool = True, **options: Any) -> str:
        """Render chat messages with the model's template (sandboxed) -> prompt text. ``options``: tools,
        tool_choice, parallel_tool_calls, enable_thinking, chat_template_kwargs (runtime/chat/turn.py)."""
        return self._render(self.chat_turn(messages, options), add_generation_prompt)

    def chat_turn(self, messages: Seq[Message], options: Mapping[str, Any]) -> ChatTurn:
        """The checked turn for ``messages`` and the chat options (tools, thinking, template arguments)."""
        return chat_turn(self.chat_template, messages, options, self.tool_parser)

    def prepare(self, source: Prompt | Seq[Message], what: str = "prompt", chat: bool | None = None,
                **params: Any) -> Prepared:
        """The one way to build a request: a prompt (text or ids) or chat messages, and the generation keyword
        arguments (sampling over the model's defaults; json_schema / regex / grammar, or ``constraint=``;
        ``speculative``, ``adapter``; for messages the chat options: tools, tool_choice, parallel_tool_calls,
        enable_thinking, chat_template_kwargs) -> a Prepared (runtime/engine/request.py).

        Messages are rendered with the chat template (the template writes any BOS itself, as transformers'
        apply_chat_template); images and videos in them are decoded and their tokens expanded. ``chat``: whether
        ``source`` is messages (None: a non-empty list of dicts is). RequestError
        (a DecodertError) names the part at fault: "messages", "tools", "prompt" or the parameter."""
        embedding = self.manifest.embedding if self.manifest is not None else None
        if embedding is not None and not embedding.causal:
            raise RequestError("this is an embedding model with bidirectional attention (EmbeddingGemma): it does not "
                               "generate text; use LLM.embed or /v1/embeddings", "model")
        params = dict(params)
        spec, adapter, given = params.pop("speculative", None), params.pop("adapter", None), params.pop("constraint", None)
        if not (_is_messages(source) if chat is None else chat):
            sp, constraint = self._params_and_constraint(params, given)
            return Prepared(self.encode(source, what=what), sp, constraint, spec, adapter, what=what)
        turn, text, ids = self._chat(source, pop_options(params))
        sp, constraint = self._params_and_constraint(params, given)
        try:
            constraint = turn.constraint(constraint)
        except DecodertError as e:
            raise RequestError(str(e), "tools") from None
        return Prepared(ids, sp, constraint, spec, adapter, turn, text, what)

    def _params_and_constraint(self, params: dict, given: Constraint | None) -> tuple[SamplingParams, Constraint | None]:
        sp, constraint = self.split_params(params)
        if given is not None:
            if constraint is not None:
                raise DecodertError("pass one of constraint= or json_schema= / regex= / grammar=, not both")
            if not isinstance(given, Constraint):
                raise DecodertError(f"constraint must be a Constraint (Constraint.of(json_schema=...)), got {type(given).__name__}")
            constraint = given
        return sp, constraint

    def _chat(self, messages: Seq[Message], options: Mapping[str, Any]) -> tuple[ChatTurn, str, np.ndarray]:
        """Messages and chat options -> (turn, rendered prompt, its ids); RequestError naming the part at fault."""
        try:
            messages, clips = self.split_audio(messages)
            messages, images = self.split_images(messages)
        except Busy:  # not the request's fault: a server answers 503
            raise
        except DecodertError as e:
            raise RequestError(str(e), "messages") from None
        try:
            turn = self.chat_turn(messages, options)
        except DecodertError as e:
            message = str(e)
            raise RequestError(message, "messages" if message.startswith("chat message")
                               else "tools" if "tool" in message else "messages") from None
        try:
            text = self._render(turn)
            return turn, text, self.prompt_ids(text, images, clips)
        except DecodertError as e:
            raise RequestError(str(e), "messages") from None

    def _render(self, turn: ChatTurn, add_generation_prompt: bool = True) -> str:
        eos = self.eos_token_ids
        return render_chat(self.chat_template, turn.messages, bos_token=self._token_str(self.bos_token_id),
                           eos_token=self._token_str(eos[0] if eos else None),
                           add_generation_prompt=add_generation_prompt, **turn.template_kwargs)

    def _token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(int(token_id)) or "")

    def split_images(self, messages: Seq[Message]) -> tuple[Seq[Message], list[np.ndarray | Video]]:
        """Image / video parts -> ``{"type": "image"}`` / ``{"type": "video"}`` for the template, and the decoded
        images and videos (runtime/vision/messages.py)."""
        messages, images = split_images(messages, self.image_limits, self.fetch_image)
        if self.vision is not None and self.vision.video is None and any(isinstance(m, Video) for m in images):
            raise DecodertError("this model takes no video (Qwen2.5-VL and Qwen3-VL do); send frames as images")
        if images and self.vision is None:
            raise DecodertError("this model takes no images (no vision.onnx in the artifact, or TensorRT engines "
                                "built before they took the image inputs: run `decodert build` again)")
        return messages, images

    def split_audio(self, messages: Seq[Message]) -> tuple[Seq[Message], list[np.ndarray]]:
        """Audio parts -> ``{"type": "audio", "audio": None}`` for the template, and the clips at the model's rate
        (runtime/audio/messages.py)."""
        if not has_audio(messages):
            return messages, []
        if self.audio is None:
            raise DecodertError(self.no_audio())
        return split_audio(messages, self.audio_limits, self.audio.sampling_rate)

    def no_audio(self) -> str:
        """Why this LLM takes no audio, in one line."""
        if self.manifest is not None and self.manifest.audio is not None:
            return ("this backend does not run audio.onnx (the trt backend runs audio.engine: run `decodert build` "
                    "again for engines built before it; the ort backend runs the graph: backend='ort')")
        return "this model takes no audio (no audio.onnx in the artifact)"

    def prompt_ids(self, text: str, images: Seq[np.ndarray | Video] = (), clips: Seq[np.ndarray] = ()) -> np.ndarray:
        """A rendered chat prompt's ids; with images, each ``<image>`` expanded as the model's processor does
        and its tokens the image's ids (runtime/vision/encoder.py); clips likewise (runtime/audio/encoder.py)."""
        if clips and self.audio is not None:  # split_audio refused clips for a model without audio
            if images:
                raise DecodertError("a prompt with both images and audio is not supported yet")
            return self.audio.prompt_ids(text, clips, lambda t: self.encode(t, add_bos=False))
        if images and self.vision is not None:  # split_images refused images for a model without vision
            return self.vision.prompt_ids(text, images, lambda t: self.encode(t, add_bos=False))
        return self.encode(text, add_bos=False)

    @property
    def guidance(self) -> Guidance:
        """Structured-output compiler for this model's tokenizer (built once, ~0.2 s)."""
        with self._guidance_lock:
            if self._guidance is None:
                self._guidance = Guidance.for_tokenizer(self.tokenizer, self.backend.vocab_size, self.eos_token_ids)
            return self._guidance

    def transcribe(self, audio: Any, sample_rate: int | None = None, language: str | None = None,
                   prompt: str | None = None, **params: Any) -> GenerationResult:
        """Speech to text: ``audio`` a path, encoded bytes, or samples with ``sample_rate`` (or a (samples, rate)
        pair); ``language`` (a code or name) forces the language, ``prompt`` is context for the system turn; the
        rest are sampling parameters. -> a GenerationResult whose text is the transcription (what follows the
        model's ``<asr_text>``, or an instruction-prompted model's whole answer: Qwen2-Audio is asked "Detect the
        language and recognize the speech:"; runtime/audio/transcribe.py) and token_ids all the generated ids."""
        prepared = self.prepare_transcription(audio, sample_rate, language, prompt, **params)
        result = self.run([self.engine.sequence(prepared)])[0]
        return dataclasses.replace(result, text=parse_transcription(result.text, None, self.audio.transcription)[1])

    def prepare_transcription(self, audio: Any, sample_rate: int | None = None, language: str | None = None,
                              prompt: str | None = None, **params: Any) -> Prepared:
        """The request ``transcribe`` runs (the server's /v1/audio/transcriptions runs it on its engine thread)."""
        if self.audio is None:
            raise DecodertError(self.no_audio())
        rate = self.audio.sampling_rate
        clip = load_audio(audio, "audio", self.audio_limits, rate, sample_rate)
        messages, prefill = transcription_messages(clip, rate, language, prompt, self.audio.transcription)
        messages, clips = self.split_audio(messages)
        text = self._render(self.chat_turn(messages, {})) + prefill
        params = dict(params)
        if params.pop("timestamps", False):
            raise DecodertError("timestamps (segments) are made by Whisper artifacts only; this model transcribes "
                                "without them")
        spec, adapter = params.pop("speculative", None), params.pop("adapter", None)
        sp, constraint = self._params_and_constraint(params, None)
        return Prepared(self.prompt_ids(text, (), clips), sp, constraint, spec, adapter, what="audio", text=text)

    def generate(self, prompt: Prompt | Seq[Prompt], **params: Any) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (-> GenerationResult) or a list of prompts (-> list, same order)."""
        if not validate.is_batch(prompt):
            return self.run([self.engine.sequence(self.prepare(prompt, **params))])[0]
        return self.run([self.engine.sequence(self.prepare(p, f"prompt {i}", **params)) for i, p in enumerate(prompt)])

    def stream(self, prompt: Prompt, **params: Any) -> TextStream:
        """Iterate the generated text as deltas (str); see TextStream for the final result."""
        if validate.is_batch(prompt):
            raise DecodertError(f"stream takes one prompt, got a batch of {len(prompt)}; use generate or generate_many")
        return self.run_stream(self.engine.sequence(self.prepare(prompt, **params)))

    def chat(self, messages: Seq[Message], **params: Any) -> GenerationResult:
        """Apply the chat template (with the generation prompt) and generate the reply. Chat options:
        ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``enable_thinking``, ``chat_template_kwargs``;
        the result's ``tool_calls`` and ``reasoning`` are split from its text (runtime/chat/turn.py)."""
        prepared = self.prepare(messages, chat=True, **params)
        return prepared.turn.finish(self.run([self.engine.sequence(prepared)])[0], prepared.text)

    def stream_chat(self, messages: Seq[Message], **params: Any) -> TextStream | ChatStream:
        """``chat`` as a stream of text deltas (with tools or reasoning: the content's, in a ChatStream)."""
        prepared = self.prepare(messages, chat=True, **params)
        stream = self.run_stream(self.engine.sequence(prepared))
        turn = prepared.turn
        return stream if turn.plain else ChatStream(stream, turn.output(prepared.text), turn.tools is not None)

    def run(self, seqs: Seq[Sequence], row: Any = None) -> list[GenerationResult]:
        """Run sequences (``engine.sequence``) to their end in one run of the engine -> their results, in order.
        ``row``: a session's pinned row (one sequence)."""
        self.runs.finish(lambda: [self.engine.add(s, row) for s in seqs])
        return [s.result() for s in seqs]

    def run_stream(self, seq: Sequence, row: Any = None) -> TextStream:
        """One sequence as a stream of text deltas; the run holds the engine until the stream ends or closes."""
        return TextStream(_by_id(self.runs.stream(lambda: [self.engine.add(seq, row)])), seq)

    @property
    def embedder(self) -> Embedder:
        """embed.onnx and its pooling rule (runtime/embedding.py); DecodertError when the artifact has none."""
        with self._embedder_lock:  # one Embedder (one embed.onnx session) per LLM, whichever thread asks first
            if self._embedder is None:
                self._embedder = Embedder(self.backend.dir, self.manifest, self.tokenizer, self.bos_token_id,
                                          self.add_bos_token)
            return self._embedder

    def embed(self, inputs: EmbedInput | Seq[EmbedInput], dimensions: int | None = None) -> np.ndarray:
        """Unit vectors [n, d] float32 of texts or token id lists (one text or one id list: n = 1), pooled as the
        manifest's ``embedding`` says; ``dimensions``: fewer dimensions (a matryoshka model), renormalised.
        Runs beside generation (its own session; no engine slot). RequestError: an input longer than max_seq,
        one with no tokens, or ``dimensions`` the model does not allow."""
        if isinstance(inputs, (str, np.ndarray)) or (isinstance(inputs, (list, tuple)) and inputs
                                                     and all(validate.is_token_id(t) for t in inputs)):
            inputs = [inputs]
        embedder = self.embedder
        return embedder.embed(embedder.token_ids(inputs), dimensions)

    def warm(self, prompts: Seq[Any]) -> list[int]:
        """Prefill prompts (text), chat message lists (rendered as a chat request renders them) or entries
        (``{"messages": [...], "tools": [...]}``: runtime/warm.py) into the prefix cache, so a later request
        that starts like one is a hit -> the tokens of each the cache now holds. DecodertError naming the
        entry: a bad one, the cache off, or an entry that did not all stay in the cache's budget."""
        return warm_prompts(self, prompts)

    def session(self, system: str | None = None, overflow: str = "truncate") -> "Session":
        """A conversation whose K/V stays in its own cache row between turns (runtime/chat/session.py):
        each turn prefills only what the chat template adds. ``overflow``: "truncate" (drop the
        oldest turns when the context fills) or "error" (raise DecodertError instead)."""
        from decodert.runtime.chat.session import Session

        session = Session(self, system, overflow)
        self._sessions.add(session)
        return session

    def resume(self, path: str | Path, convert_kv: bool = False) -> "Session":
        """A session saved by ``Session.save(path)``, its row holding the saved ids, K/V and states, so its next
        turn is the one the saved session would have given (runtime/chat/saved.py). DamagedState (one line): a
        damaged, truncated or foreign file. ``convert_kv``: take a file of the same model saved with another
        float K/V type (fp32 / fp16 / bf16), converted as the cache stores values; refused without it."""
        from decodert.runtime.chat.session import Session

        return Session.resume(self, path, convert_kv)

    def generate_many(self, requests: Seq[Request | Mapping[str, Any]]) -> list[GenerationResult]:
        """Continuous batching: requests take free cache slots as others finish; results in order (a chat
        request's split as ``chat`` splits it: reasoning, tool_calls, finish_reason)."""
        validate.check_sequence_arg(requests, "requests")
        if not requests:
            raise DecodertError("the list of requests is empty")
        prepared = [self._request_prepared(r, i) for i, r in enumerate(requests)]
        results = self.run([self.engine.sequence(p) for p in prepared])
        return [r if p.turn is None else p.turn.finish(r, p.text or "") for p, r in zip(prepared, results)]

    def _request_prepared(self, req: Request | Mapping[str, Any], i: int) -> Prepared:
        validate.check_request(req, i, Request)
        what = f"request {i}"
        own: SamplingParams | None = None  # a Request's own SamplingParams: validated, then used as it is
        if isinstance(req, Mapping):
            prompt, messages = req.get("prompt"), req.get("messages")
            rest = {k: v for k, v in req.items() if k not in ("prompt", "messages")}
        else:
            own = req.params
            if own is not None:
                sampling_params(own)  # validate
            if req.constraint is not None and not isinstance(req.constraint, Constraint):
                raise DecodertError(f"request {i}: constraint must be a Constraint (Constraint.of(json_schema=...)), "
                                    f"got {type(req.constraint).__name__}")
            prompt, messages = req.prompt, req.messages
            rest = {"speculative": req.speculative, "adapter": req.adapter, "constraint": req.constraint}
        if (prompt is None) == (messages is None):
            raise DecodertError(f"request {i} needs exactly one of 'prompt' or 'messages'")
        prepared = self.prepare(prompt if messages is None else messages, what, messages is not None, **rest)
        if own is not None:
            prepared = dataclasses.replace(prepared, params=own)
        return prepared

def _by_id(events: Any) -> Any:
    """(handle, delta) events -> (request id, delta); closing it closes the run's stream."""
    try:
        for handle, delta in events:
            yield handle.id, delta
    finally:
        events.close()


def _is_messages(source: Any) -> bool:
    """Chat messages (a list of dicts) rather than a prompt (text, ids)."""
    return isinstance(source, (list, tuple)) and bool(source) and isinstance(source[0], Mapping)

