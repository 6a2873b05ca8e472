"""Models and the hidden-state extractor.

`--model builtin[:hidden=256,layers=8,vocab=1024,...]` builds a small Llama-architecture model with
deterministic random weights locally (no download). Any other spec is a local Hugging Face model directory,
loaded with `transformers` (the optional `hsbuild[hf]` extra).

Hidden-state indices follow Hugging Face's `output_hidden_states` convention: index 0 is the embedding
output, index k (1 <= k < L) the output of decoder layer k-1, and index L the output of the last layer after
the final norm. EAGLE-3 (SpecForge) keeps the outputs of layers 1, L/2-1 and L-4, i.e. indices 2, L//2 and
L-3, plus the final hidden state (index L).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from builder.errors import ModelError, SampleError
from builder.extract.backends.base import check_finite
from builder.extract.builtin_model import (  # noqa: F401 - re-exported (the built-in model's own module)
    Block,
    BuiltinLlama,
    RMSNorm,
    _rope,
    _spans,
    segments,
)
from builder.extract.final_norm import read_final_norm
from builder.extract.spec import (  # noqa: F401 - re-exported: the torch-free half (builder/extract/spec.py)
    CONVENTION,
    BuiltinSpec,
    BuiltinTokenizer,
    HfTokenizer,
    builtin_tokenizer,
    bytes_per_token,
    check_aux_layers,
    check_device_spec,
    check_dtype_and_final_state,
    check_max_tokens,
    default_aux_layers,
    is_builtin,
    one_line,
    read_hf,
    suggest_chunk_tokens,
)
from builder.extract.threads import FIXED_THREADING, fix_threading  # noqa: F401 - re-exported
from builder.formats.final_state import FinalNorm
from builder.store.dtypes import torch_dtype

# ---------------------------------------------------------------------------------------------------
# The extractor
# ---------------------------------------------------------------------------------------------------


def spread_device(device: str, worker: int, gpus: int) -> str:
    """The device worker `worker` runs on: `cuda` or `auto` with several GPUs visible puts each worker on GPU
    `worker mod gpus` (a run of 8 workers on an 8-GPU node uses all 8, not the first one 8 times); `cpu`,
    `cuda:N` and one GPU or none are kept as given."""
    if device in ("auto", "cuda") and gpus > 1:
        return f"cuda:{worker % gpus}"
    return device


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelError(f"--device '{device}': not a torch device; use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device '{device}': CUDA is not available here; use --device cpu")
    return dev


def quiet_third_party() -> None:
    """No progress bars or info chatter of transformers or huggingface_hub in hsbuild's output (the run draws its
    own progress); their warnings and errors still show."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers  # noqa: PLC0415

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_warning()
    except (ImportError, AttributeError):
        pass


class Extractor:
    """Loads a model and extracts the EAGLE-3 auxiliary hidden states plus the final hidden state."""

    def __init__(self, spec: str, aux_layers: list[int] | None = None, dtype: str = "bfloat16",
                 device: str = "auto", load_weights: bool = True, final_state: str = "post_norm"):
        check_dtype_and_final_state(dtype, final_state)
        self.final_state = final_state
        self._pre: list[torch.Tensor] = []
        self._keep_logits = True  # pass logits_to_keep=1 to a Hugging Face model (see _hf_states)
        self.spec, self.dtype_name, self.dtype = spec, dtype, torch_dtype(dtype)
        self.device = pick_device(device)
        self.tokenizer = None
        if is_builtin(spec):
            s = BuiltinSpec.parse(spec)
            self.num_layers, self.hidden_size, self.vocab_size, self.max_positions = (
                s.layers, s.hidden, s.vocab, s.max_positions)
            model = BuiltinLlama(s)
            model.init_deterministic()
            self._model = model.to(self.dtype).to(self.device).eval()
            self._hf = False
            self.tokenizer = builtin_tokenizer(s.vocab)
            self.fingerprint = self._weights_fingerprint(s.canonical())
        else:
            self._model = None
            self._load_hf(spec, load_weights)
        self.aux_layers = check_aux_layers(list(aux_layers) if aux_layers else default_aux_layers(self.num_layers),
                                           self.num_layers)
        if self._model is not None and final_state == "pre_norm":  # the last decoder layer's own output
            self._last_layer().register_forward_hook(lambda _m, _i, out: self._pre.append(
                out[0] if isinstance(out, tuple) else out))

    def _last_layer(self) -> nn.Module:
        model = self._model
        for path in ("layers", "model.layers", "model.language_model.layers", "language_model.model.layers"):
            obj = model
            try:
                for part in path.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            return obj[-1]
        raise ModelError(f"--model '{self.spec}': cannot find its decoder layers for --final-state pre_norm")

    def final_norm(self) -> FinalNorm:
        """The final RMSNorm (weight in the model dtype, epsilon), to be kept in the build."""
        if not self._hf:
            norm = self._model.norm
            return FinalNorm(norm.weight.detach().to(self.dtype).cpu().clone(), float(norm.eps))
        return read_final_norm(Path(self.spec), self.dtype)

    def check_max_tokens(self, max_tokens: int | None) -> None:
        check_max_tokens(max_tokens, self.max_positions)

    # -- loading ------------------------------------------------------------------------------------
    def _weights_fingerprint(self, prefix: str) -> str:
        h = hashlib.blake2b(prefix.encode(), digest_size=8)
        for name, t in self._model.state_dict().items():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def _load_hf(self, spec: str, load_weights: bool) -> None:
        """A local HF directory. Dimensions, tokenizer and fingerprint come from its files; the weights are
        loaded only when extracting (never by `init` or `doctor`)."""
        path = Path(spec)
        f = read_hf(spec)
        self.num_layers, self.hidden_size, self.vocab_size, self.max_positions = (
            f.num_layers, f.hidden_size, f.vocab_size, f.max_positions)
        self.fingerprint, self.tokenizer, self._hf = f.fingerprint, f.tokenizer, True
        if not load_weights:
            return
        import transformers  # noqa: PLC0415

        quiet_third_party()  # transformers' "Loading weights" bars, one per worker, in hsbuild's own output
        local = {"local_files_only": True}  # read_hf found the directory: never a request to the hub
        try:
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype, **local)
            except TypeError:  # transformers < 4.56 knows only torch_dtype
                model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=self.dtype, **local)
        except Exception as e:  # noqa: BLE001 - report any loader failure as a model error
            raise ModelError(f"--model '{spec}': cannot load ({type(e).__name__}: {one_line(e)})") from e
        self._model = model.to(self.device).eval()

    # -- extraction -----------------------------------------------------------------------------------
    def metadata(self) -> dict:
        return {
            "model": self.spec,
            "model_fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "aux_layers": self.aux_layers,
            "final_layer": self.num_layers,
            "convention": CONVENTION,
            "final_state": self.final_state,
            "dtype": self.dtype_name,
        }

    def check(self, input_ids: np.ndarray, max_tokens: int | None) -> np.ndarray:
        """Validate one sample's tokens; returns them, truncated to max_tokens. Raises SampleError."""
        n = int(input_ids.shape[0])
        if n == 0:
            raise SampleError("empty_sample", "the sample has no tokens")
        if max_tokens is not None and n > max_tokens:
            input_ids = input_ids[:max_tokens]
        if input_ids.shape[0] > self.max_positions:  # the limit is min(max_tokens, positions)
            if n != input_ids.shape[0]:  # (init refuses a --max-tokens above the positions)
                raise SampleError("too_long", f"{n} tokens, {input_ids.shape[0]} of them kept under --max-tokens, "
                                              f"exceed the model's {self.max_positions} positions")
            raise SampleError(
                "too_long", f"{n} tokens exceed the model's {self.max_positions} positions, and this build cuts "
                f"nothing (made without --max-tokens); a build made with --max-tokens {self.max_positions} or less "
                "keeps such samples cut; or leave it out: hsbuild skip")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise SampleError("token_out_of_range", f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        return input_ids

    @torch.inference_mode()
    def extract(self, input_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass; returns (aux [n, len(aux)*H], final [n, H]) on the CPU in the model dtype."""
        if self._model is None:
            raise ModelError(f"{self.spec}: opened for metadata only (load_weights=False)")
        ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).unsqueeze(0).to(self.device)
        if self._hf:
            states = self._hf_states(ids)
        else:
            states = self._model(ids)
        aux = torch.cat([states[i][0] for i in self.aux_layers], dim=-1)
        if self.final_state == "pre_norm":
            final = self._pre.pop()[0]
            self._pre.clear()
        else:
            final = states[self.num_layers][0]
        bad = check_finite("", aux, final)
        if bad is not None:
            raise SampleError(bad.reason, bad.message)
        return aux.to("cpu"), final.to("cpu")


    def _hf_states(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The model's hidden states (HF's `output_hidden_states`). The language-model head runs on the last
        position only (`logits_to_keep=1`): its logits are not wanted, and for all positions they cost a
        vocabulary-wide matrix product and [n, vocab] float memory a sample (2 GB for 4k tokens of a 128k
        vocabulary). The hidden states are the same either way: the head reads them, it does not feed them."""
        if self._keep_logits:
            try:
                return self._model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
            except TypeError:  # a model whose forward takes no logits_to_keep (older or custom code)
                self._keep_logits = False
        return self._model(input_ids=ids, output_hidden_states=True).hidden_states

    def generate(self, input_ids: np.ndarray, gen, limit: int):  # noqa: ANN001, ANN201 - (base.Generation)
        """Generate after `input_ids` with a KV cache, the states captured on the way (builder/extract/generation.py);
        `limit`: the positions prompt and response may take together."""
        if self._model is None:
            raise ModelError(f"{self.spec}: opened for metadata only (load_weights=False)")
        from builder.extract.generation import generate  # noqa: PLC0415

        return generate(self, input_ids, gen, limit)

    def generate_batch(self, requests: list, limit: int) -> list:
        """Several generations (each `(input_ids, Generation)`) decoded together, each request's result what
        `generate` gives it alone, bit for bit, or the exception it raises (builder/extract/generation_batch.py)."""
        if self._model is None:
            raise ModelError(f"{self.spec}: opened for metadata only (load_weights=False)")
        from builder.extract.generation_batch import generate_batch  # noqa: PLC0415

        return generate_batch(self, requests, limit)

    # -- batched extraction -------------------------------------------------------------------------------
    def can_pack(self) -> bool:
        """Whether `extract_batch` runs one packed forward pass (the built-in model, a Hugging Face Llama with
        SDPA attention); otherwise it runs `extract` once per sample."""
        return self._model is not None and (not self._hf or self._hf_llama() is not None)

    def _hf_llama(self):
        """The decoder of a Hugging Face Llama whose layers a packed pass can drive exactly as its own forward
        pass does (embed, rotary tables, per layer: norm, attention, add, norm, MLP, add; final norm), or None."""
        inner = getattr(self._model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return None
        if getattr(self._model.config, "_attn_implementation", None) != "sdpa":
            return None  # a lone pass with eager attention gets a mask the packed one would have to rebuild
        if getattr(self._model.config, "pretraining_tp", 1) != 1:
            return None
        if not all(type(layer).__name__ == "LlamaDecoderLayer" for layer in inner.layers):
            return None
        return inner

    def _hf_forward_packed(self, inner, ids: torch.Tensor, lengths: list[int]):
        spans = _spans(lengths)
        x = inner.embed_tokens(ids)
        # each sample's rotary tables, from the call its own pass makes (positions 0..n-1 as int64, [1, n])
        ropes = [inner.rotary_emb(x[:, a:a + n], torch.arange(n, device=ids.device).unsqueeze(0)) for a, n in spans]
        states = [x]
        for layer in inner.layers[: inner.config.num_hidden_layers]:
            attend = _HfAttention(layer.self_attn, ropes)  # no cache: a lone pass's cache only copies k and v
            x = x + segments(attend, layer.input_layernorm(x), spans)
            x = x + segments(_HfMlp(layer.mlp), layer.post_attention_layernorm(x), spans)
            states.append(x)
        pre = x
        states[-1] = inner.norm(x)
        return states, pre

    @torch.inference_mode()
    def extract_batch(self, batch: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor] | Exception]:
        """Several samples' states from one packed forward pass: for each, what `extract` returns for it, bit for
        bit (see `segments`), or the exception it raises (a SampleError: non-finite states fail their sample
        alone). A model that cannot be packed, or a packed pass that raises (out of memory), runs `extract` once
        per sample."""
        if self._model is None:
            raise ModelError(f"{self.spec}: opened for metadata only (load_weights=False)")
        if len(batch) > 1 and self.can_pack():
            try:
                return self._extract_packed(batch)
            except Exception:  # noqa: BLE001 - each sample gets its own chance (and its own error) below
                self._pre.clear()
        out: list[tuple[torch.Tensor, torch.Tensor] | Exception] = []
        for input_ids in batch:
            try:
                out.append(self.extract(input_ids))
            except Exception as e:  # noqa: BLE001 - a SampleError, or any other error: this sample's alone
                out.append(e)
        return out

    def _extract_packed(self, batch: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor] | SampleError]:
        lengths = [int(x.shape[0]) for x in batch]
        ids = torch.from_numpy(np.concatenate([np.ascontiguousarray(x, dtype=np.int64) for x in batch]))
        ids = ids.unsqueeze(0).to(self.device)
        if self._hf:
            states, pre = self._hf_forward_packed(self._hf_llama(), ids, lengths)
        else:
            states, pre = self._model.forward_packed(ids, lengths)
        last = pre if self.final_state == "pre_norm" else states[self.num_layers]
        out: list[tuple[torch.Tensor, torch.Tensor] | SampleError] = []
        for a, n in _spans(lengths):
            aux = torch.cat([states[i][0, a:a + n] for i in self.aux_layers], dim=-1)
            final = last[0, a:a + n].clone()  # its own tensor: the batch's states are not kept alive by it
            bad = check_finite("", aux, final)
            out.append(SampleError(bad.reason, bad.message) if bad is not None else (aux.to("cpu"), final.to("cpu")))
        return out


class _HfAttention:
    """A Hugging Face attention module called on one sample's normed states, as its decoder layer calls it in a
    lone pass (no mask: SDPA's causal kernel; the sample's rotary tables)."""

    def __init__(self, module, ropes):
        self.module, self.ropes = module, ropes

    def __call__(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.module(hidden_states=h, position_embeddings=self.ropes[i], attention_mask=None)[0]


class _HfMlp:
    def __init__(self, module):
        self.module = module

    def __call__(self, _i: int, h: torch.Tensor) -> torch.Tensor:
        return self.module(h)
