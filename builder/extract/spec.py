"""What the run's coordinator, init and doctor need to know of a model without loading it (and without importing
torch, which costs seconds at every command's start): the built-in model's spec and tokenizer, a Hugging Face
directory's tokenizer (loaded at first use), aux-layer and device checks, sizes. The models themselves are in
builder/extract/model.py."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from builder.errors import ModelError
from builder.extract.chat import hf_chat, template_of
from builder.store.dtypes import STATE_DTYPES, itemsize

CONVENTION = "hf_hidden_states: 0=embeddings, k=output of layer k-1, L=final-norm output"


@dataclass(frozen=True)
class BuiltinSpec:
    hidden: int = 256
    layers: int = 8
    vocab: int = 1024
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    max_positions: int = 4096
    seed: int = 0
    nan_token: int = -1  # testing aid: this token's embedding is NaN, so its sample fails `nonfinite`

    @classmethod
    def parse(cls, spec: str) -> BuiltinSpec:
        if spec == "builtin":
            return cls()
        if not spec.startswith("builtin:"):
            raise ModelError(f"--model '{spec}': not a builtin spec")
        kwargs: dict[str, int] = {}
        names = {f for f in cls.__dataclass_fields__}
        for part in filter(None, spec[len("builtin:") :].split(",")):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ModelError(
                    f"--model '{spec}': bad key '{part}'; use builtin:key=value,... with keys {sorted(names)}"
                )
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ModelError(f"--model '{spec}': '{key}' needs an integer, got '{value}'") from None
        s = cls(**kwargs)
        if s.hidden % s.heads or s.heads % s.kv_heads or (s.hidden // s.heads) % 2:
            raise ModelError(
                f"--model '{spec}': hidden must divide by heads, heads by kv_heads, and head size must be even"
            )
        if min(s.hidden, s.layers, s.vocab, s.heads, s.kv_heads, s.intermediate, s.max_positions) < 1:
            raise ModelError(f"--model '{spec}': sizes must be positive")
        return s

    def canonical(self) -> str:
        return "builtin:" + ",".join(f"{k}={v}" for k, v in asdict(self).items())


class BuiltinTokenizer:
    """Byte-level tokenizer of the built-in model: BOS=1, EOS=2, then UTF-8 bytes shifted by 3.

    Its chat template is byte-level too (no role tokens, so any vocabulary takes it): BOS, then each message as
    the bytes of `<|ROLE|>` and a newline, its content's bytes and EOS, which ends a turn; the prompt of the
    assistant's next turn (`prompt`, what a regenerating build generates after) ends with `<|assistant|>` and a
    newline. The loss mask is 1 on an assistant message's content and its EOS. EOS is the token that stops a
    generated turn (`STOP_IDS`). A `Tokenizer` and a `PromptTokenizer` (extract/chat.py); calling it is `encode`."""

    BOS, EOS = 1, 2
    STOP_IDS = (EOS,)

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *self._bytes(text)]

    __call__ = encode

    def _bytes(self, text: str) -> list[int]:
        return [(b + 3) % self.vocab for b in text.encode("utf-8")]

    def _render(self, messages: list[dict], prompt: bool) -> tuple[list[int], list[int]]:
        ids, mask = [self.BOS], [0]
        for m in messages:
            head = self._bytes(f"<|{m['role']}|>\n")
            body = [*self._bytes(m.get("content") or ""), self.EOS]
            ids += head + body
            mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
        if prompt:
            head = self._bytes("<|assistant|>\n")
            ids += head
            mask += [0] * len(head)
        return ids, mask

    def chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        return self._render(messages, prompt=False)

    def prompt(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        return self._render(messages, prompt=True)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids: ids 3..258 are bytes; BOS, EOS and ids above the bytes are left out."""
        return bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259).decode("utf-8", errors="replace")

    def has_chat_template(self) -> bool:
        return True


def builtin_tokenizer(vocab: int) -> BuiltinTokenizer:
    return BuiltinTokenizer(vocab)


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's EAGLE-3 default as hidden_states indices: outputs of layers 1, L/2-1 and L-4 (2, L//2, L-3).

    From 7 layers on this is every trainer's own default too (SpecForge's and Model-Optimizer's decoder ids
    1, L//2-1, L-4; speculators' engine layer ids 2, L//2, L-3), so none needs to be told the layers.

    Below 7 layers those three are not distinct (L=6 gives 2, 3, 3), and no trainer's default is usable:
    speculators refuses its own (repeated ids), Model-Optimizer's is a set of fewer than three (its first step
    fails on three-layer states), SpecForge's repeats a layer. Such small models take 1, L//2, L-1 instead:
    three distinct layers below L, which every trainer accepts once told (SpecForge
    `model.aux_hidden_state_layer_ids`, speculators `--target-layer-ids`, Model-Optimizer
    `eagle_aux_hidden_state_layer_ids`; `init` and `export` print each one's: BuildInfo.layer_flag), and which
    an engine backend can serve (ids below L). A model with fewer than 4 layers has no three distinct
    intermediate states to default to."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers >= 4:
        return [1, num_layers // 2, num_layers - 1]
    raise ModelError(
        f"a {num_layers}-layer model has fewer than 3 distinct intermediate hidden states for the default aux "
        f"layers; choose them with --aux-layers (hidden_states indices 0..{num_layers})"
    )


def check_aux_layers(aux_layers: list[int], num_layers: int) -> list[int]:
    """Refuse an empty list, duplicates and indices outside 0..L (hidden_states indices of an L-layer model)."""
    if not aux_layers:
        raise ModelError("--aux-layers: give at least one hidden_states index, e.g. 2,16,29")
    for i in aux_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_layers:
            raise ModelError(
                f"--aux-layers: index {i} is outside 0..{num_layers} (hidden_states indices of a "
                f"{num_layers}-layer model)"
            )
    dups = sorted({i for i in aux_layers if aux_layers.count(i) > 1})
    if dups:
        raise ModelError(f"--aux-layers {','.join(map(str, aux_layers))}: index {dups[0]} appears more than once; "
                         "each aux layer must be a different hidden_states index")
    return list(aux_layers)


def check_device_spec(device: str) -> None:
    """`auto`, `cpu`, `cuda` or `cuda:N` (syntax only: init may run where the GPUs are not)."""
    if device != "auto" and not re.fullmatch(r"(cpu|cuda)(:[0-9]+)?", device):
        raise ModelError(f"--device '{device}': use auto, cpu, cuda or cuda:N")


class HfTokenizer:
    """A Hugging Face directory's tokenizer, loaded at its first use: importing transformers costs seconds, and
    sources of input_ids (and the engine backends' workers) never need it.

    A `Tokenizer` (extract/chat.py): `encode(text)` for `text` rows (calling it is `encode`), `chat(messages)` for
    conversation rows, with the tokenizer's chat template."""

    def __init__(self, path: Path):
        self.path = path
        self._tok = None

    def _load(self):
        if self._tok is None:
            require_tokenizer_files(self.path)  # else transformers may build an empty tokenizer, or ask the hub
            try:
                import transformers  # noqa: PLC0415

                self._tok = transformers.AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            except Exception as e:  # noqa: BLE001 - any loader failure is the model directory's
                raise ModelError(f"--model '{self.path}': its tokenizer cannot be loaded ({type(e).__name__}: "
                                 f"{one_line(e)}); a source with 'text' or conversation rows needs one (or give "
                                 "input_ids)") from None
        return self._tok

    @property
    def loaded(self) -> bool:
        """Whether a row needed it (its files then decided the samples' tokens)."""
        return self._tok is not None

    def encode(self, text: str) -> list[int]:
        return self._load()(text)["input_ids"]

    __call__ = encode

    def chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        return hf_chat(self._load(), messages, f"the tokenizer of --model '{self.path}'")

    def prompt(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        return hf_chat(self._load(), messages, f"the tokenizer of --model '{self.path}'", prompt=True)

    def decode(self, ids: list[int]) -> str:
        return self._load().decode([int(i) for i in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def has_chat_template(self) -> bool:
        return template_of(self._load()) is not None


def check_dtype_and_final_state(dtype: str, final_state: str) -> None:
    """ModelError naming --dtype or --final-state for a value hsbuild does not know."""
    from builder.formats.final_state import FINAL_STATES  # noqa: PLC0415

    if dtype not in STATE_DTYPES:
        raise ModelError(f"--dtype '{dtype}': use one of {sorted(STATE_DTYPES)}")
    if final_state not in FINAL_STATES:
        raise ModelError(f"--final-state '{final_state}': use one of {', '.join(FINAL_STATES)}")


def is_builtin(spec: str) -> bool:
    return spec == "builtin" or spec.startswith("builtin:")


# A Hugging Face directory's tokenizer: its `tokenizers` serialization, or the vocabulary a slow tokenizer is made
# from (sentencepiece, tiktoken, BPE, WordPiece). A tokenizer_config.json alone is none: transformers 5 then builds
# an empty tokenizer that turns every text into nothing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "spm.model",
                   "tiktoken.model", "tekken.json", "vocab.json", "vocab.txt")


def require_tokenizer_files(path: Path) -> None:
    """ModelError naming the directory and tokenizer.json when `path` holds no tokenizer: checked here, on the
    local files, before transformers is asked (it never reaches the hub for a local directory; see read_hf)."""
    try:
        names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    except OSError as e:
        raise ModelError(f"--model '{path}': cannot list the directory for its tokenizer ({e.strerror})") from None
    if not names.intersection(TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        raise ModelError(f"--model '{path}': no tokenizer in {path} (no tokenizer.json, nor a vocabulary such as "
                         "tokenizer.model or vocab.json); a source with 'text' or conversation rows needs one (or "
                         "give input_ids)")


def one_line(e: BaseException) -> str:
    """An exception's message on one line (transformers' span several)."""
    return " ".join(str(e).split())


@dataclass(frozen=True)
class HfFiles:
    """What a Hugging Face model directory's files say: dimensions (config.json), fingerprint, tokenizer."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    fingerprint: str
    tokenizer: HfTokenizer


def read_hf(spec: str) -> HfFiles:
    """A local Hugging Face directory's dimensions, fingerprint and tokenizer (loaded at first use); ModelError
    naming --model for a directory that is not one, or when transformers is not installed."""
    from builder.extract.weights import directory_fingerprint  # noqa: PLC0415

    path = Path(spec)
    if not path.is_dir():  # a local directory only: a name that is not one is never looked up on the hub
        raise ModelError(f"--model '{spec}': not 'builtin[:...]' and no such directory (a local Hugging Face "
                         "model directory; nothing is downloaded)")
    if not (path / "config.json").is_file():
        raise ModelError(f"--model '{spec}': not a Hugging Face model directory (no config.json in {spec})")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"--model '{spec}': config.json is unreadable ({e})") from e
    text = cfg.get("text_config") or cfg  # multimodal checkpoints nest the language model's config
    try:
        layers, hidden, vocab = int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"--model '{spec}': config.json lacks {e} (num_hidden_layers, hidden_size, "
                         "vocab_size)") from None
    positions = int(text.get("max_position_embeddings") or 1 << 30)
    try:  # the files' contents (cached per file by inode, size, mtime and ctime): see extract/weights.py
        fingerprint = directory_fingerprint(path)
    except OSError as e:
        raise ModelError(f"--model '{spec}': cannot read its files to fingerprint them ({e})") from e
    if importlib.util.find_spec("transformers") is None:  # (not imported here: that costs seconds)
        raise ModelError(f"--model '{spec}': Hugging Face models need `pip install hsbuild[hf]`")
    return HfFiles(layers, hidden, vocab, positions, fingerprint, HfTokenizer(path))


@dataclass(frozen=True)
class ModelInfo(HfFiles):
    """What `init` records of a Hugging Face model directory, read from its files without torch or transformers
    (`Extractor(..., load_weights=False)` reads the same, but imports torch: a second of every `init`): the
    attributes and `metadata()` of an Extractor."""

    spec: str
    aux_layers: list[int]
    final_state: str = "post_norm"
    dtype_name: str = "bfloat16"

    @classmethod
    def read(cls, spec: str, aux_layers: list[int] | None = None, dtype: str = "bfloat16",
             final_state: str = "post_norm") -> ModelInfo:
        check_dtype_and_final_state(dtype, final_state)
        f = read_hf(spec)
        aux = check_aux_layers(list(aux_layers) if aux_layers else default_aux_layers(f.num_layers), f.num_layers)
        return cls(**{k: getattr(f, k) for k in HfFiles.__dataclass_fields__}, spec=spec, aux_layers=aux,
                   final_state=final_state, dtype_name=dtype)

    def metadata(self) -> dict:
        return {"model": self.spec, "model_fingerprint": self.fingerprint, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "aux_layers": self.aux_layers,
                "final_layer": self.num_layers, "convention": CONVENTION, "final_state": self.final_state,
                "dtype": self.dtype_name}

    def check_max_tokens(self, max_tokens: int | None) -> None:
        check_max_tokens(max_tokens, self.max_positions)


def check_max_tokens(max_tokens: int | None, max_positions: int) -> None:
    """`--max-tokens` above the model's positions would let over-long samples through: refuse it."""
    if max_tokens is not None and max_tokens > max_positions:
        raise ModelError(f"--max-tokens {max_tokens}: more than the model's {max_positions} positions "
                         f"(max_position_embeddings); use at most {max_positions}")


def bytes_per_token(hidden_size: int, n_aux: int, dtype: str = "bfloat16") -> int:
    """Uncompressed bytes a token costs in the build (states + input_ids int32 + loss_mask uint8)."""
    width = itemsize(dtype)
    return (n_aux + 1) * hidden_size * width + 4 + 1


def suggest_chunk_tokens(hidden_size: int, n_aux: int, median_tokens: int, target_bytes: int = 8 << 20) -> int:
    """Chunk length along the token axis: aux chunks near `target_bytes`, not longer than a typical sample."""
    per_token = n_aux * hidden_size * 2
    limit = max(16, min(4096, target_bytes // max(per_token, 1), max(median_tokens, 16)))
    return 1 << int(math.floor(math.log2(limit)))


def stop_ids(spec: str, tokenizer: object = None) -> tuple[int, ...]:
    """The token ids that end a generated turn (a regenerating build): the built-in model's EOS; a Hugging Face
    directory's `eos_token_id` (an id or a list) as transformers' `generate` reads it, from generation_config.json,
    else config.json, else the tokenizer's eos token. Read from the files, without transformers for the first two."""
    if is_builtin(spec):
        return BuiltinTokenizer.STOP_IDS
    path = Path(spec)
    for name in ("generation_config.json", "config.json"):
        try:
            cfg = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(cfg, dict):
            continue
        value = cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id"))
        ids = value if isinstance(value, list) else [value]
        found = tuple(dict.fromkeys(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)))
        if found:
            return found
    eos = getattr(getattr(tokenizer, "_load", lambda: None)(), "eos_token_id", None)
    return (int(eos),) if isinstance(eos, int) else ()
