"""Codec study on extracted states: which codec for a build's hidden states (ratio, encode and decode speed),
measured on states a model actually produced, not on random normals.

    python tools/study_codecs.py                       # builtin model + a transformers Llama, 24 samples each
    python tools/study_codecs.py --samples 8 --models builtin
    python tools/study_codecs.py --hf-dir DIR          # a local Hugging Face model directory of your own

For each model, the samples' auxiliary states ([n, 3H] bf16) and final states ([n, H]) are extracted by
hsbuild's own Extractor, cut into the chunks a build would store (`suggest_chunk_tokens`, as `init` picks them)
and encoded with every candidate, one thread, in one run:

- lossless: zstd at fast (negative) and usual levels, zstd after a 2-byte shuffle (numcodecs Shuffle: the bf16
  high bytes, sign and exponent, compress; the low mantissa bytes do not), blosc lz4/zstd with byte shuffle,
  bit shuffle and none. Every decode is checked bit-exact.
- lossy, opt-in candidates only: FP8 (float8_e4m3fn) with one float32 scale a token, as speculators'
  FP8 hidden-states connector stores it (hs_connectors/fp8_utils.py: scale = amax / 448 over the token's
  values), raw and zstd:1-compressed; its round-trip error is reported (relative RMS error, max abs error
  over max abs value).

Ratios are bytes / bf16 bytes; speeds are MB/s of bf16 bytes (10^6) per thread, the median of --rounds.
The transformers Llama is built here from a config with transformers' own random initialisation (no download
happens at run time): its activations are a forward pass's, not a trained model's; run with `--hf-dir` on your
model before choosing a codec for it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numcodecs
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.extract.model import Extractor, suggest_chunk_tokens  # noqa: E402
from builder.store.codec import to_storage  # noqa: E402

MB = 1_000_000
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass
class Candidate:
    name: str
    encode: Callable[[np.ndarray], bytes]
    decode: Callable[[bytes, np.ndarray], None]  # into a preallocated uint16 array of the chunk's shape
    lossy: bool = False


def lossless(name: str, codec) -> Candidate:
    return Candidate(name, lambda a: bytes(codec.encode(a)), lambda b, out: codec.decode(b, out=out))


def shuffled_zstd(level: int) -> Candidate:
    sh, z = numcodecs.Shuffle(elementsize=2), numcodecs.Zstd(level=level)
    return Candidate(f"shuffle+zstd:{level}", lambda a: bytes(z.encode(sh.encode(a))),
                     lambda b, out: sh.decode(z.decode(b), out=out))


def fp8(zstd_level: int | None) -> Candidate:
    """Per-token FP8: the chunk's rows quantized, a float32 scale per row (stored after the values)."""
    z = numcodecs.Zstd(level=zstd_level) if zstd_level is not None else None

    def encode(a: np.ndarray) -> bytes:
        x = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).float()
        scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        q = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        raw = q.tobytes() + scale.numpy().astype(np.float32).tobytes()
        return bytes(z.encode(raw)) if z is not None else raw

    def decode(b: bytes, out: np.ndarray) -> None:
        raw = bytes(z.decode(b)) if z is not None else b
        n, w = out.shape
        q = torch.frombuffer(bytearray(raw[: n * w]), dtype=torch.uint8).view(torch.float8_e4m3fn).view(n, w)
        scale = torch.frombuffer(bytearray(raw[n * w :]), dtype=torch.float32).view(n, 1)
        out[:] = to_storage(q.to(torch.bfloat16) * scale.to(torch.bfloat16))

    return Candidate("fp8 per-token" + (f" + zstd:{zstd_level}" if z is not None else ""), encode, decode, True)


def candidates() -> list[Candidate]:
    out = [Candidate("none", lambda a: a.tobytes(), lambda b, o: o.reshape(-1).__setitem__(
        slice(None), np.frombuffer(b, dtype=np.uint16)))]
    out += [lossless(f"zstd:{lv}", numcodecs.Zstd(level=lv)) for lv in (-5, -1, 1, 3, 9)]
    out += [shuffled_zstd(lv) for lv in (-1, 1, 3)]
    for cname, levels in (("lz4", (1, 5)), ("zstd", (1, 3))):
        for lv in levels:
            out.append(lossless(f"blosc-{cname}:{lv} shuffle", numcodecs.Blosc(cname=cname, clevel=lv, shuffle=1,
                                                                              typesize=2)))
    out.append(lossless("blosc-lz4:5 bitshuffle", numcodecs.Blosc(cname="lz4", clevel=5, shuffle=2, typesize=2)))
    out.append(lossless("blosc-lz4:5 noshuffle", numcodecs.Blosc(cname="lz4", clevel=5, shuffle=0, typesize=2)))
    out += [fp8(None), fp8(1)]
    return out


def hf_llama(tmp: Path) -> str:
    import transformers  # noqa: PLC0415

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp / "llama")
    return str(tmp / "llama")


def states(spec: str, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The samples' aux and final states (uint16 views of bf16), concatenated along tokens, and the chunk length."""
    ex = Extractor(spec, device="cpu")
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.5, 0.6, size=samples).astype(int), 16, 2048)
    aux, fin = [], []
    for n in lengths:
        a, f = ex.extract(rng.integers(3, ex.vocab_size, size=int(n)).astype(np.int32))
        aux.append(to_storage(a.to(torch.bfloat16).cpu()))
        fin.append(to_storage(f.to(torch.bfloat16).cpu()))
    chunk = suggest_chunk_tokens(ex.hidden_size, len(ex.aux_layers), int(np.median(lengths)))
    return np.concatenate(aux), np.concatenate(fin), chunk


def chunks_of(a: np.ndarray, chunk: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(a[i : i + chunk]) for i in range(0, a.shape[0] - chunk + 1, chunk)] or [a]


def measure(c: Candidate, chunks: list[np.ndarray], rounds: int) -> dict:
    nbytes = sum(x.nbytes for x in chunks)
    enc_t, dec_t = [], []
    encoded: list[bytes] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        encoded = [c.encode(x) for x in chunks]
        enc_t.append(time.perf_counter() - t0)
    outs = [np.empty_like(x) for x in chunks]
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b, o in zip(encoded, outs, strict=True):
            c.decode(b, o)
        dec_t.append(time.perf_counter() - t0)
    row = {"ratio": sum(map(len, encoded)) / nbytes, "enc": nbytes / statistics.median(enc_t) / MB,
           "dec": nbytes / statistics.median(dec_t) / MB}
    if c.lossy:
        x = torch.from_numpy(np.concatenate(chunks).view(np.int16)).view(torch.bfloat16).float()
        y = torch.from_numpy(np.concatenate(outs).view(np.int16)).view(torch.bfloat16).float()
        row["rel_rms"] = float((x - y).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
        row["max_rel"] = float((x - y).abs().max() / x.abs().max())
    elif not all(np.array_equal(x, o) for x, o in zip(chunks, outs, strict=True)):
        raise SystemExit(f"{c.name}: decode is not bit-exact")
    return row


def report(title: str, chunks: list[np.ndarray], rounds: int) -> None:
    nbytes = sum(x.nbytes for x in chunks)
    print(f"\n{title}: {len(chunks)} chunks of {chunks[0].shape[0]} tokens x {chunks[0].shape[1]}, "
          f"{nbytes / MB:.1f} MB bf16\n")
    print("| codec | bytes vs bf16 | encode MB/s | decode MB/s | round-trip error |")
    print("|---|---:|---:|---:|---|")
    for c in candidates():
        r = measure(c, chunks, rounds)
        err = (f"rel RMS {r['rel_rms']:.2e}, max {r['max_rel']:.2e} of max |x|" if c.lossy else "bit-exact")
        print(f"| {c.name} | {r['ratio']:.3f} | {r['enc']:,.0f} | {r['dec']:,.0f} | {err} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="builtin,hf", help="comma-separated: builtin, builtin:..., hf")
    ap.add_argument("--hf-dir", help="a local Hugging Face model directory to use for `hf`")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the forward passes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="hsbuild-study-") as tmp:
        for m in args.models.split(","):
            spec = (args.hf_dir or hf_llama(Path(tmp))) if m == "hf" else m
            label = "transformers Llama (random init)" if m == "hf" and not args.hf_dir else spec
            aux, fin, chunk = states(spec, args.samples, args.seed)
            report(f"{label}: aux states", chunks_of(aux, chunk), args.rounds)
            report(f"{label}: final states", chunks_of(fin, chunk), args.rounds)


if __name__ == "__main__":
    main()
