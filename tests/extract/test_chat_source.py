"""Conversation rows (OpenAI `messages`, ShareGPT `conversations`) tokenized with the model's chat template, their
loss mask on the assistant's tokens; and a `datasets` save_to_disk directory (speculators' preprocessed data) as
a source, read with pyarrow only.

The Hugging Face model is a tiny Llama saved here, with a byte-level BPE tokenizer trained here on a few strings
(no download); its chat template comes in two forms, with and without `{% generation %}` markers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from conftest import write_jsonl

from builder.errors import SourceError
from builder.extract.model import HfTokenizer, builtin_tokenizer
from builder.extract.source import fingerprint, load_source

try:
    import transformers
except ImportError:  # the dataset-directory tests need no transformers
    transformers = None
hf = pytest.mark.skipif(transformers is None, reason="the [hf] extra is not installed (pip install -e '.[hf]')")

SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
CORPUS = ["You are a helpful assistant.", "Hello there, how are you today?", "I am fine, thank you for asking.",
          "What is the answer to six times seven?", "The answer is 42.", "Tell me a joke about tokens.",
          "A tokenizer walks into a bar and splits."]
# the header and the turn's end are the template's own; the content is the message's
_TURN = "{{ '<|' + m['role'] + '|>\\n' }}"
TEMPLATE_GEN = ("{{ bos_token }}{% for m in messages %}" + _TURN +
                "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
                "{% else %}{{ m['content'] }}<|end|>{% endif %}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
TEMPLATE_PLAIN = ("{{ bos_token }}{% for m in messages %}" + _TURN + "{{ m['content'] }}<|end|>{{ '\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

CONV = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello there, how are you today?"},
    {"role": "assistant", "content": "I am fine, thank you for asking."},
    {"role": "user", "content": "What is the answer to six times seven?"},
    {"role": "assistant", "content": "The answer is 42."},
]
SHAREGPT = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
            for m in CONV]


def _save_tokenizer(directory: Path, template: str | None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                additional_special_tokens=SPECIAL[2:])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(directory)


def make_model(directory: Path, template: str | None, weights: bool = False) -> Path:
    """A tiny Llama directory: config (weights too when asked) and a tokenizer with `template`."""
    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    if weights:
        import torch

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    else:
        directory.mkdir(parents=True)
        cfg.save_pretrained(directory)
    _save_tokenizer(directory, template)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    return {"gen": make_model(root / "gen", TEMPLATE_GEN), "plain": make_model(root / "plain", TEMPLATE_PLAIN),
            "none": make_model(root / "none", None)}


@pytest.fixture(scope="module")
def hf_tok(models):
    return transformers.AutoTokenizer.from_pretrained(str(models["plain"]))


def masked_text(tok, sample) -> list[str]:
    """The decoded runs of loss_mask == 1, one string per run."""
    runs, cur = [], []
    for t, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


# ---------------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------------


@hf
@pytest.mark.parametrize("template", ["gen", "plain"])
def test_loss_mask_is_exactly_the_assistant_content_and_its_end_of_turn(tmp_path, models, hf_tok, template):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONV}])
    (s,) = load_source(src, HfTokenizer(models[template]))
    rendered = hf_tok.apply_chat_template(CONV, tokenize=False)
    assert hf_tok.decode(s.input_ids.tolist()) == rendered  # the template's rendering, tokenized as transformers does
    assert s.input_ids.tolist() == hf_tok(rendered, add_special_tokens=False)["input_ids"]
    assert masked_text(hf_tok, s) == [m["content"] + "<|end|>" for m in CONV if m["role"] == "assistant"]
    assert s.fingerprint == fingerprint(s.input_ids, s.loss_mask)


@hf
def test_both_templates_give_the_same_sample(tmp_path, models):
    convs = [CONV, CONV[:3], CONV[1:3], [CONV[1], {"role": "assistant", "content": "  padded reply  "}],
             CONV[:2], [{"role": "assistant", "content": "The answer is 42."}, CONV[1]],
             [{"role": "user", "content": "The answer is 42."}, {"role": "assistant", "content": "The answer is 42."},
              {"role": "user", "content": "The answer is 42."}]]  # the assistant's text in the user's turns too
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    gen = load_source(src, HfTokenizer(models["gen"]))
    plain = load_source(src, HfTokenizer(models["plain"]))
    for a, b in zip(gen, plain, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()
        assert a.fingerprint == b.fingerprint
    assert gen[4].loss_mask.sum() == 0  # no assistant turn: nothing trains
    assert gen[5].loss_mask.sum() > 0  # an assistant turn first
    tok = transformers.AutoTokenizer.from_pretrained(str(models["plain"]))
    assert masked_text(tok, plain[6]) == ["The answer is 42.<|end|>"]
    assert tok.decode(plain[6].input_ids[plain[6].loss_mask.astype(bool)].tolist()) == "The answer is 42.<|end|>"
    first = int(np.flatnonzero(plain[6].loss_mask)[0])
    assert tok.decode(plain[6].input_ids[:first].tolist()).endswith("<|user|>\nThe answer is 42.<|end|>\n<|assistant|>\n")


@hf
def test_sharegpt_and_openai_forms_give_identical_samples(tmp_path, models):
    tok = HfTokenizer(models["plain"])
    a = load_source(write_jsonl(tmp_path / "openai.jsonl", [{"id": "c1", "messages": CONV}]), tok)
    b = load_source(write_jsonl(tmp_path / "sharegpt.jsonl", [{"id": "c1", "conversations": SHAREGPT}]), tok)
    assert [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist(), s.fingerprint) for s in a] == \
        [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist(), s.fingerprint) for s in b]


@hf
def test_mixed_rows_input_ids_win_and_parquet_reads_the_same(tmp_path, models):
    tok = HfTokenizer(models["gen"])
    rows = [{"id": "a", "messages": CONV}, {"id": "b", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
            {"id": "c", "input_ids": [9, 10], "messages": CONV},  # explicit tokens win
            {"id": "d", "text": "Hello there"}, {"id": "e", "conversations": SHAREGPT[:3]}]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    samples = load_source(src, tok, vocab_size=384)
    assert [s.sample_id for s in samples] == ["a", "b", "c", "d", "e"]
    assert samples[1].loss_mask.tolist() == [0, 1, 1] and samples[2].input_ids.tolist() == [9, 10]
    assert samples[3].loss_mask.tolist() == [1] * samples[3].num_tokens
    pq = tmp_path / "mixed.parquet"
    pa_rows = [{"id": r["id"], "messages": r.get("messages"), "conversations": r.get("conversations"),
                "input_ids": r.get("input_ids"), "loss_mask": r.get("loss_mask"), "text": r.get("text")} for r in rows]
    import pyarrow.parquet as pq_mod

    pq_mod.write_table(pa.Table.from_pylist(pa_rows), pq)
    again = load_source(pq, tok, vocab_size=384)
    assert [(s.sample_id, s.fingerprint) for s in again] == [(s.sample_id, s.fingerprint) for s in samples]


@hf
def test_same_fingerprint_when_tokenized_again(tmp_path, models):
    """A resume tokenizes the source again: the samples it registers must be the same ones."""
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONV}, {"conversations": SHAREGPT[:3]}])
    first = load_source(src, HfTokenizer(models["gen"]))
    second = load_source(src, HfTokenizer(models["gen"]))
    assert [s.fingerprint for s in first] == [s.fingerprint for s in second]


def _err(tmp_path, rows, tokenizer) -> SourceError:
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(SourceError) as ei:
        load_source(src, tokenizer)
    e = ei.value
    assert e.path == str(src) and "\n" not in str(e)
    return e


BAD_CONVERSATIONS = [
    ("role", {"messages": [CONV[1], CONV[2], {"role": "robot", "content": "beep"}]}, "messages[2].role",
     "'robot' is not one of system, user, assistant, tool"),
    ("no-role", {"messages": [{"content": "hi"}]}, "messages[0].role", "missing"),
    ("no-content", {"messages": [CONV[1], {"role": "assistant"}]}, "messages[1].content", "missing"),
    ("int-content", {"messages": [CONV[1], {"role": "assistant", "content": 5}]}, "messages[1].content",
     "must be a string, not a number"),
    ("not-a-list", {"messages": "hello"}, "messages", "must be a list of messages"),
    ("empty", {"messages": []}, "messages", "is empty"),
    ("not-an-object", {"messages": [CONV[1], "hi"]}, "messages[1]", "must be an object"),
    ("with-loss-mask", {"messages": CONV, "loss_mask": [1, 0]}, "loss_mask", "comes from the chat template"),
    ("sharegpt-role", {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
     "conversations[1].from", "'bot' is not one of human, gpt, system"),
    ("sharegpt-value", {"conversations": [{"from": "human"}]}, "conversations[0].value", "missing"),
    ("both", {"messages": CONV, "conversations": SHAREGPT}, "conversations", "not both"),
]


@hf
@pytest.mark.parametrize(("row", "field", "message"), [b[1:] for b in BAD_CONVERSATIONS],
                         ids=[b[0] for b in BAD_CONVERSATIONS])
def test_bad_conversations_name_line_and_field(tmp_path, models, row, field, message):
    e = _err(tmp_path, [{"messages": CONV}, {"input_ids": [5, 6]}, row], HfTokenizer(models["plain"]))
    assert e.line == 3 and e.field == field and message in str(e), str(e)
    assert str(e).startswith(f"{e.path}:3: field '{field}': ")


def test_conversation_with_the_builtin_model_uses_its_byte_level_template(tmp_path):
    """The built-in model has a byte-level chat template (issue 43, so that regeneration needs no download; it
    refused conversation rows before): `<|role|>` and a newline, the content's bytes, EOS (2) ending each turn;
    the mask 1 on an assistant's content and its EOS. A plain text -> ids function still has no template."""
    tok = builtin_tokenizer(1024)
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONV}, {"conversations": SHAREGPT}])
    a, b = load_source(src, tok)
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    text = "".join(f"<|{m['role']}|>\n{m['content']}\x02" for m in CONV)
    assert tok.decode(a.input_ids) == text.replace("\x02", "") and int(a.input_ids[0]) == 1
    assert a.input_ids.tolist().count(2) == len(CONV)  # one EOS a turn
    masked = [int(t) for t, m in zip(a.input_ids, a.loss_mask, strict=True) if m]
    assert tok.decode(masked) == "".join(m["content"] for m in CONV if m["role"] == "assistant")
    assert masked.count(2) == 2  # each assistant turn's EOS is its own
    ids, mask = tok.prompt(CONV[:2])
    assert tok.decode(ids).endswith("<|assistant|>\n") and sum(mask) == 0
    e = _err(tmp_path, [{"messages": CONV}], lambda text: [1, 2])  # a plain text -> ids function
    assert e.field == "messages" and "no chat template" in str(e)


@hf
def test_hf_tokenizer_without_a_chat_template(tmp_path, models):
    e = _err(tmp_path, [{"text": "Hello"}, {"messages": CONV}], HfTokenizer(models["none"]))
    assert e.line == 2 and e.field == "messages" and "has no chat_template" in str(e)
    assert str(models["none"]) in str(e)


@hf
def test_template_that_refuses_a_conversation(tmp_path):
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
              "{% endif %}{{ m['content'] }}<|end|>{% endfor %}")
    model = make_model(tmp_path / "strict", strict)
    e = _err(tmp_path, [{"messages": CONV[1:3]}, {"messages": CONV}], HfTokenizer(model))
    assert e.line == 2 and e.field == "messages" and "refuses this conversation (no system role)" in str(e)


@hf
def test_template_that_trims_and_spaces_before_eos(tmp_path):
    """A Llama-2-like template: `{{ content | trim }} </s>`; the end-of-turn token (and the space before it) is the
    assistant's, the next turn's header is not."""
    llama2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] | trim }} "
              "</s>{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|assistant|>' }}{% endif %}{% endfor %}")
    model = make_model(tmp_path / "llama2", llama2)
    conv = [CONV[1], {"role": "assistant", "content": " I am fine, thank you for asking.\n"}, CONV[3],
            {"role": "assistant", "content": "The answer is 42."}]
    (s,) = load_source(write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}]), HfTokenizer(model))
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    assert masked_text(tok, s) == ["I am fine, thank you for asking. </s>", "The answer is 42. </s>"]


@hf
def test_template_that_changes_the_assistant_text(tmp_path):
    upper = "{% for m in messages %}{{ '<|' + m['role'] + '|>' + (m['content'] | upper) }}<|end|>{% endfor %}"
    e = _err(tmp_path, [{"messages": CONV}], HfTokenizer(make_model(tmp_path / "upper", upper)))
    assert e.line == 1 and e.field == "messages[2].content" and "does not render" in str(e)
    assert "{% generation %}" in str(e)


@hf
def test_cli_init_with_conversations_and_a_hf_model(tmp_path, cli):
    model = make_model(tmp_path / "tiny", TEMPLATE_GEN, weights=True)
    rows = [{"id": "c0", "messages": CONV}, {"id": "c1", "conversations": SHAREGPT[1:3]},
            {"id": "c2", "messages": CONV[:3]}]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    expected = load_source(src, HfTokenizer(model))
    cp = cli("init", tmp_path / "b", "--source", src, "--model", model, "--low", "0.997", "--high", "0.998",
             "--flood", "0.999")  # watermarks near 100%: the test machine's disk may be fairly full
    assert cp.returncode == 0, cp.stderr
    cp = cli("sql", tmp_path / "b", "SELECT sample_id, source_tokens, fingerprint FROM samples ORDER BY sample_id",
             "--json")
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == [{"sample_id": s.sample_id, "source_tokens": s.num_tokens,
                                      "fingerprint": s.fingerprint} for s in expected]
    cp = cli("sql", tmp_path / "b", "SELECT sum(source_tokens) AS n FROM samples", "--json")
    assert json.loads(cp.stdout) == [{"n": sum(s.num_tokens for s in expected)}]

    # a run tokenizes the source again and finds the same samples; their stored loss masks are the template's
    from builder.reader import HiddenStateDataset
    from builder.run.coordinator import RunOptions, run_build

    assert run_build(tmp_path / "b", RunOptions(device="cpu", allow_overcommit=True),
                     echo=lambda *a, **k: None).exit_code == 0
    got = {item["sample_id"]: item for item in HiddenStateDataset(tmp_path / "b")}
    assert sorted(got) == ["c0", "c1", "c2"]
    for s in expected:
        assert got[s.sample_id]["input_ids"].tolist() == s.input_ids.tolist()
        assert got[s.sample_id]["loss_mask"].tolist() == s.loss_mask.tolist()

    # the built-in model takes them too, with its byte-level chat template (issue 43; it refused them before)
    cp = cli("init", tmp_path / "b2", "--source", src, "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr


# ---------------------------------------------------------------------------------------------------
# A `datasets` save_to_disk directory (speculators' preprocessed data)
# ---------------------------------------------------------------------------------------------------


def write_dataset_dir(directory: Path, columns: dict[str, list], shards: int = 1,
                      types: dict[str, pa.DataType] | None = None) -> Path:
    """What `datasets.Dataset.from_dict(columns).save_to_disk(directory, num_shards=shards)` writes (datasets
    5.x): Arrow IPC stream files `data-XXXXX-of-NNNNN.arrow` with the features in the schema's `huggingface`
    metadata, `dataset_info.json` and `state.json` listing the files in order."""
    directory.mkdir(parents=True)
    schema = pa.schema([(k, (types or {}).get(k) or pa.array(v).type) for k, v in columns.items()])
    table = pa.Table.from_pydict(columns, schema=schema)

    def feature(t: pa.DataType) -> dict:
        if pa.types.is_list(t):
            return {"feature": feature(t.value_type), "_type": "List"}
        return {"dtype": "bool" if pa.types.is_boolean(t) else str(t), "_type": "Value"}

    features = {f.name: feature(f.type) for f in schema}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    n, files = table.num_rows, []
    bounds = [round(k * n / shards) for k in range(shards + 1)]
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with ipc.new_stream(str(directory / name), schema.with_metadata(meta)) as w:
            w.write_table(table.slice(bounds[k], bounds[k + 1] - bounds[k]))
        files.append({"filename": name})
    (directory / "dataset_info.json").write_text(json.dumps(
        {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}, indent=2))
    (directory / "state.json").write_text(json.dumps(
        {"_data_files": files, "_fingerprint": "0123456789abcdef", "_format_columns": None, "_format_kwargs": {},
         "_format_type": None, "_output_all_columns": False, "_split": None}, indent=2))
    return directory


def speculators_columns(n: int = 7, seed: int = 0) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        k = int(rng.integers(3, 40))
        ids.append(rng.integers(3, 1024, size=k).tolist())
        masks.append([0] * (k // 2) + [1] * (k - k // 2))
    return {"input_ids": ids, "loss_mask": masks, "seq_len": [len(x) for x in ids]}


def test_dataset_dir_source(tmp_path):
    cols = speculators_columns()
    d = write_dataset_dir(tmp_path / "prep", cols, shards=3)
    samples = load_source(d, vocab_size=1024)
    assert [s.sample_id for s in samples] == [str(i) for i in range(7)]  # speculators' hs_{i}
    assert [s.input_ids.tolist() for s in samples] == cols["input_ids"]
    assert [s.loss_mask.tolist() for s in samples] == cols["loss_mask"]
    # the same rows from JSONL give the same samples
    rows = [{"input_ids": a, "loss_mask": m} for a, m in zip(cols["input_ids"], cols["loss_mask"], strict=True)]
    as_jsonl = load_source(write_jsonl(tmp_path / "same.jsonl", rows))
    assert [(s.sample_id, s.fingerprint) for s in samples] == [(s.sample_id, s.fingerprint) for s in as_jsonl]


def test_dataset_dir_bool_mask_and_int32_ids_and_messages_column(tmp_path):
    cols = speculators_columns(4)
    cols["loss_mask"] = [[bool(x) for x in m] for m in cols["loss_mask"]]
    cols["messages"] = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]] * 4
    d = write_dataset_dir(tmp_path / "prep", cols, types={"input_ids": pa.list_(pa.int32()),
                                                          "loss_mask": pa.list_(pa.bool_())})
    samples = load_source(d, builtin_tokenizer(1024))  # input_ids win over messages: no chat template needed
    assert [s.loss_mask.tolist() for s in samples] == [[int(x) for x in m] for m in cols["loss_mask"]]


def test_dataset_dir_order_follows_state_json(tmp_path):
    cols = speculators_columns(6)
    d = write_dataset_dir(tmp_path / "prep", cols, shards=2)
    state = json.loads((d / "state.json").read_text())
    state["_data_files"].reverse()
    (d / "state.json").write_text(json.dumps(state))
    samples = load_source(d)
    assert [s.input_ids.tolist() for s in samples] == cols["input_ids"][3:] + cols["input_ids"][:3]


def test_dataset_dir_errors(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(SourceError, match="is a directory without state.json"):
        load_source(plain)
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(SourceError, match="DatasetDict .splits: train, test.; pass one split's directory"):
        load_source(dd)

    d = write_dataset_dir(tmp_path / "missing", speculators_columns(3))
    (d / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(SourceError, match="data-00000-of-00001.arrow: is missing"):
        load_source(d)

    d = write_dataset_dir(tmp_path / "garbage", speculators_columns(3))
    (d / "data-00000-of-00001.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(SourceError, match="is not an Arrow IPC stream"):
        load_source(d)

    d = write_dataset_dir(tmp_path / "nostate", speculators_columns(3))
    (d / "state.json").write_text("{}")
    with pytest.raises(SourceError, match="_data_files"):
        load_source(d)

    cols = speculators_columns(3)
    cols["loss_mask"][2] = cols["loss_mask"][2][:-1]
    d = write_dataset_dir(tmp_path / "short", cols)
    with pytest.raises(SourceError) as ei:
        load_source(d)
    assert ei.value.field == "loss_mask" and "(row index 2)" in str(ei.value) and "\n" not in str(ei.value)

    cols = speculators_columns(3)
    cols["seq_len"][1] += 1
    d = write_dataset_dir(tmp_path / "seqlen", cols)
    with pytest.raises(SourceError) as ei:
        load_source(d)
    assert ei.value.field == "seq_len" and "(row index 1)" in str(ei.value)

    d = write_dataset_dir(tmp_path / "vocab", speculators_columns(3))
    with pytest.raises(SourceError) as ei:
        load_source(d, vocab_size=10)
    assert ei.value.field == "input_ids" and "outside the model's vocabulary" in str(ei.value)


def test_cli_init_from_a_dataset_dir(tmp_path, cli):
    cols = speculators_columns(5)
    d = write_dataset_dir(tmp_path / "prep", cols, shards=2)
    cp = cli("init", tmp_path / "b", "--source", d)
    assert cp.returncode == 0, cp.stderr
    cp = cli("sql", tmp_path / "b", "SELECT sample_id, source_tokens FROM samples ORDER BY CAST(sample_id AS INT)",
             "--json")
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == [{"sample_id": str(i), "source_tokens": len(x)} for i, x in
                                     enumerate(cols["input_ids"])]


def _python_with_datasets() -> str | None:
    """This interpreter when `datasets` is installed here (the `trainers` extra, as CI installs it), else
    $HSBUILD_SPECULATORS_PYTHON."""
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        return sys.executable
    return os.environ.get("HSBUILD_SPECULATORS_PYTHON")


SPECULATORS_PYTHON = _python_with_datasets()


@pytest.mark.skipif(not SPECULATORS_PYTHON, reason="needs `datasets` (pip install -e .[trainers], or set "
                                                   "HSBUILD_SPECULATORS_PYTHON to a python with it) to check a "
                                                   "directory written by datasets' own save_to_disk")
def test_a_real_datasets_save_to_disk_dir_reads_the_same(tmp_path):
    cols = speculators_columns(9)
    script = textwrap.dedent("""
        import json, sys
        import datasets
        cols = json.loads(open(sys.argv[1]).read())
        datasets.Dataset.from_dict(cols).save_to_disk(sys.argv[2], num_shards=3)
    """)
    (tmp_path / "cols.json").write_text(json.dumps(cols))
    cp = subprocess.run([SPECULATORS_PYTHON, "-c", script, str(tmp_path / "cols.json"), str(tmp_path / "real")],
                        capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr
    real = load_source(tmp_path / "real")
    ours = load_source(write_dataset_dir(tmp_path / "ours", cols, shards=3))
    assert [(s.sample_id, s.fingerprint) for s in real] == [(s.sample_id, s.fingerprint) for s in ours]
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert [s.input_ids.tolist() for s in real] == cols["input_ids"]
