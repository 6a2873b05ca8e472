"""The built-in sample set for `hsbuild demo`: a few hundred varied-length samples, deterministic, no download."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = ("the cat sat on a warm mat while storage filled quietly and nobody noticed until the volume "
         "stopped answering writes so the team counted files by hand").split()


def write_demo_source(path: Path, n: int = 300, vocab: int = 1024, seed: int = 0) -> Path:
    """Write `n` samples as JSONL: most as input_ids with a prompt-masked loss_mask, every 10th as text."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=5.0, sigma=0.7, size=n).astype(int), 4, 1500)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i, n_tok in enumerate(lengths):
            sid = f"demo-{i:04d}"
            if i % 10 == 9:
                text = " ".join(rng.choice(WORDS, size=max(2, int(n_tok) // 5)))
                f.write(json.dumps({"id": sid, "text": text}) + "\n")
                continue
            ids = rng.integers(3, vocab, size=int(n_tok)).tolist()
            prompt = int(n_tok) // 3
            mask = [0] * prompt + [1] * (int(n_tok) - prompt)
            f.write(json.dumps({"id": sid, "input_ids": ids, "loss_mask": mask}) + "\n")
    tmp.replace(path)
    return path


QUESTIONS = ("what filled the volume", "who counted the files", "why did the writes stop", "where did the cat sit")


def write_demo_chats(path: Path, n: int = 8) -> Path:
    """Write `n` short conversations as JSONL (OpenAI messages; every other with two assistant turns): what the
    demo's regeneration hint (`init --regenerate`, docs/regenerate.md) regenerates."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]}?"},
                    {"role": "assistant", "content": "nobody noticed"}]
            if i % 2:
                msgs += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "the team did"}]
            f.write(json.dumps({"id": f"chat-{i:02d}", "messages": msgs}) + "\n")
    tmp.replace(path)
    return path
