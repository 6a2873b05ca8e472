"""Imported once, after builder/run/zygote.py, in the fork server of a process whose runs load a Hugging Face
model (builder/run/worker_start.py: `worker_context(hf=True)`): transformers and its model classes, about 3
CPU-seconds that each worker would otherwise pay on its own. (A spawned standby worker imports it itself, while
it waits for its settings: builder/run/standby.py.) Imports only, as in zygote.py: nothing of
hsbuild's, no model, no tokenizer, no GPU. The variables these libraries read when imported (HF_*,
TRANSFORMERS_*, ...) are compared before a server with them is used (`HF_IMPORT_TIME`)."""

from __future__ import annotations

try:
    import transformers

    transformers.AutoModelForCausalLM  # noqa: B018 - a lazy module: this imports the model classes
except Exception:  # noqa: BLE001, S110 - a broken install: the worker that loads the model reports it in its words
    pass
