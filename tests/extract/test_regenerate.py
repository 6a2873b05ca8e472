"""Regeneration (issue 43) with a Hugging Face model: `init --regenerate` on a tiny Llama saved here (no download),
its chat template the test's own; checked against transformers itself.

- the stored sample is the final prompt (the chat template with its generation prompt) followed by exactly the
  tokens transformers' greedy `generate` gives (do_sample=False, the same max_new_tokens and eos ids), and
  with --turns all each earlier turn is what generate gives after the regenerated turns before it;
- its states equal a transformers forward pass over the stored tokens within bf16 rounding (they are captured
  while generating, with the KV cache, not by a second prefill);
- run with --batch-tokens (its generations decoded together), the samples are the same, bit for bit;
- responses that stopped at the token limit are counted in status (text and --json), the samples view and the
  Prometheus metrics, as transformers says they stop; --drop-truncated retires exactly those."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import write_jsonl
from test_chat_source import TEMPLATE_PLAIN, make_model

from builder.layout import layout
from builder.log.events import EventLog
from builder.log.metrics import StatusCollector
from builder.reader import HiddenStateDataset

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

MAX_NEW = 8
USERS = ["Hello there, how are you today?", "What is the answer to six times seven?",
         "Tell me a joke about tokens.", "The answer is 42.", "I am fine, thank you for asking."]
ROWS = [{"id": f"u{i}", "messages": [{"role": "user", "content": u}]} for i, u in enumerate(USERS)]
TWO_TURNS = {"id": "two", "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello there, how are you today?"},
    {"role": "assistant", "content": "I am fine, thank you for asking."},
    {"role": "user", "content": "What is the answer to six times seven?"},
    {"role": "assistant", "content": "The answer is 42."}]}


def _greedy(model, ids: list[int], eos: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def _prompt(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny Llama with a chat template and weights, its eos ids chosen so that some of ROWS' greedy responses
    stop (an eos id) within MAX_NEW tokens and others run to the limit: (directory, model, tokenizer, eos ids)."""
    d = make_model(tmp_path_factory.mktemp("regen-model") / "m", TEMPLATE_PLAIN, weights=True)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    plain = [_greedy(model, _prompt(tok, r["messages"]), [2]) for r in ROWS]
    # the third token of the first response stops it; a token that some other response never generates
    stop = next(t for t in plain[0][2:] if any(t not in s for s in plain[1:]))
    gc = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gc, "eos_token_id": [2, stop]}))
    return d, model, tok, [2, stop]


def _states(model, ids: list[int], aux_layers: list[int]):
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in aux_layers], dim=-1), hs[len(hs) - 1][0]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within bf16 rounding: the cached decode and a full forward pass round differently."""
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * scale)


def test_greedy_regeneration_equals_transformers(tmp_path, cli, chat_model):
    d, model, tok, eos = chat_model
    src = write_jsonl(tmp_path / "chats.jsonl", [*ROWS, TWO_TURNS])
    build = tmp_path / "b"
    cp = cli("init", build, "--source", src, "--model", d, "--regenerate", "--max-new-tokens", str(MAX_NEW),
             "--final-state", "post_norm", "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    cp = cli("run", build, "--no-progress", "--device", "cpu", "--workers", "1")
    assert cp.returncode == 0, cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        meta = log.meta()
        written = {r[0]: json.loads(r[1]) for r in log.query(
            "SELECT sample_id, detail FROM events WHERE kind = 'written'")[1]}
        view = {r[0]: r[1:] for r in log.query("SELECT sample_id, finish_reason, generated FROM samples")[1]}
    assert meta["regenerate"] is True and meta["stop_ids"] == eos and meta["turns"] == "all"
    assert (meta["max_new_tokens"], meta["temperature"], meta["top_p"]) == (MAX_NEW, 0.0, 1.0)

    expected: dict[str, tuple[list[int], list[int], list[int]]] = {}  # id -> (prompt, generated, prompt mask)
    for r in ROWS:
        prompt = _prompt(tok, r["messages"])
        expected[r["id"]] = (prompt, _greedy(model, prompt, eos), [0] * len(prompt))
    # --turns all: the first assistant turn regenerated, its text in the conversation, then the second
    msgs = TWO_TURNS["messages"]
    first = _greedy(model, _prompt(tok, msgs[:2]), eos)
    text = tok.decode([t for t in first if t not in eos], skip_special_tokens=True)
    again = [*msgs[:2], {"role": "assistant", "content": text}, msgs[3]]
    prompt = _prompt(tok, again)
    expected["two"] = (prompt, _greedy(model, prompt, eos), None)

    items = {it["sample_id"]: it for it in HiddenStateDataset(build)}
    assert sorted(items) == sorted(expected)
    reasons = {}
    for sid, (prompt, generated, mask) in expected.items():
        it = items[sid]
        assert it["input_ids"].tolist() == prompt + generated, sid
        n = len(prompt)
        assert it["loss_mask"][n:].tolist() == [1] * len(generated)
        if mask is not None:
            assert it["loss_mask"][:n].tolist() == mask
        reasons[sid] = "stop" if generated[-1] in eos else "length"
        assert written[sid]["finish_reason"] == reasons[sid] and written[sid]["generated"] == len(generated)
        assert written[sid]["turns"] == (2 if sid == "two" else 1) and isinstance(written[sid]["seed"], int)
        assert view[sid] == (reasons[sid], len(generated))
        aux, final = _states(model, prompt + generated, meta["aux_layers"])
        _close(it["aux_hidden_state"], aux)
        _close(it["hidden_state"], final)
    # the earlier regenerated turn's text is masked in the final prompt: the template's assistant content
    two = items["two"]
    n = len(expected["two"][0])
    masked = [t for t, m in zip(two["input_ids"][:n].tolist(), two["loss_mask"][:n].tolist(), strict=True) if m]
    assert tok.decode(masked, skip_special_tokens=True).strip() == text.strip() and masked
    assert "stop" in reasons.values() and "length" in reasons.values()  # (the data holds both kinds)
    cut = sum(r == "length" for r in reasons.values())

    st = json.loads(cli("status", build, "--json").stdout)
    assert st["at_token_limit"] == cut and st["dropped_at_token_limit"] == 0
    text_status = cli("status", build).stdout
    assert f"responses: {cut} stopped at the token limit" in text_status
    metrics = {(s.name, tuple(s.labels.items())): s.value
               for fam in StatusCollector(lambda: st).collect() for s in fam.samples}
    assert metrics[("hsbuild_responses_at_token_limit", (("outcome", "kept"),))] == cut

    # batched (--batch-tokens: the generations decoded together): the same samples, bit for bit
    batched = tmp_path / "batched"
    cp = cli("init", batched, "--source", src, "--model", d, "--regenerate", "--max-new-tokens", str(MAX_NEW),
             "--final-state", "post_norm", "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    cp = cli("run", batched, "--no-progress", "--device", "cpu", "--workers", "1", "--batch-tokens", "4096")
    assert cp.returncode == 0, cp.stderr
    again = {it["sample_id"]: it for it in HiddenStateDataset(batched)}
    assert sorted(again) == sorted(items)
    for sid, it in again.items():
        assert it["input_ids"].tolist() == items[sid]["input_ids"].tolist(), sid
        assert it["loss_mask"].tolist() == items[sid]["loss_mask"].tolist(), sid
        assert torch.equal(it["aux_hidden_state"], items[sid]["aux_hidden_state"]), sid
        assert torch.equal(it["hidden_state"], items[sid]["hidden_state"]), sid

    # --drop-truncated: the same responses, those cut at the limit retired with their reason, the others written
    dropped = tmp_path / "dropped"
    cp = cli("init", dropped, "--source", src, "--model", d, "--regenerate", "--max-new-tokens", str(MAX_NEW),
             "--final-state", "post_norm", "--drop-truncated", "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    cp = cli("run", dropped, "--no-progress", "--device", "cpu", "--workers", "1")
    assert cp.returncode == 0, cp.stderr
    assert f"{cut} regenerated response(s) stopped at the token limit" in cp.stderr and "retired" in cp.stderr
    with EventLog(layout(dropped).events, read_only=True) as log:
        states = dict(log.query("SELECT sample_id, state || ':' || coalesce(retired_reason, '') FROM samples")[1])
        gone = dict(log.query("SELECT sample_id, finish_reason FROM samples WHERE state = 'retired'")[1])
    assert states == {sid: "retired:at_token_limit" if r == "length" else "written:" for sid, r in reasons.items()}
    assert set(gone.values()) == {"length"}
    st = json.loads(cli("status", dropped, "--json").stdout)
    assert st["dropped_at_token_limit"] == cut and st["at_token_limit"] == 0 and st["total"] == len(reasons) - cut
    assert sorted(it["sample_id"] for it in HiddenStateDataset(dropped)) == sorted(
        sid for sid, r in reasons.items() if r == "stop")
    np.testing.assert_array_equal(  # the kept ones are the same samples as in the first build
        next(it for it in HiddenStateDataset(dropped) if it["sample_id"] == "u0")["input_ids"],
        items["u0"]["input_ids"])
