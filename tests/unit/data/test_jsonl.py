"""data=jsonl: fine-tuning documents packed into rows with per-document positions and prompt labels
masked. The packed batch and its loss are checked against what the test computes by hand: the
documents tokenized with the `tokenizers` library directly, packed greedily in file order, and the
loss of each document run alone through transformers' LlamaForCausalLM (the same weights), with
the cross entropy of its response tokens written out in plain torch. Bad files are refused by
`validate` with every bad line's number (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.hf_models import write_hf_model
from helpers.tokenizers_tiny import write_jsonl, write_tokenizer

pytest.importorskip("transformers")

SEQ = 32  # llama/tiny's seq_len
EOS = 2  # </s> in the test's tokenizer (tokenizer_config.json names it)
DOCS = [
    {"text": "the quick brown fox"},
    {"prompt": "question: what is two plus two?", "response": " answer: four"},
    {"text": "def add(a, b):\n    return a + b " * 4},  # longer than a row: cut at SEQ + 1 tokens
    {"prompt": "the lazy dog " * 12, "response": "four"},  # its prompt fills the row: nothing to learn
    {"prompt": "what does fleetwise pack?", "response": " documents into rows"},
    {"text": "the lazy dog jumps over the fox"},
]


def by_hand(tokenizer_file):
    """(ids, prompt length) per document, and the rows they pack into, computed here."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    docs = []
    for d in DOCS:
        if "text" in d:
            ids, p = tok.encode(d["text"]).ids + [EOS], 0
        else:
            prompt = tok.encode(d["prompt"]).ids
            ids, p = prompt + tok.encode(d["response"], add_special_tokens=False).ids + [EOS], len(prompt)
        ids = ids[: SEQ + 1]
        if len(ids) - max(p, 1) > 0:  # a target token outside the prompt
            docs.append((ids, min(p, len(ids))))
    rows, row = [], []
    for ids, p in docs:
        if sum(len(i) - 1 for i, _ in row) + len(ids) - 1 > SEQ:
            rows.append(row)
            row = []
        row.append((ids, p))
    return rows + [row]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A Hugging Face Llama directory holding the test's tokenizer, and data=jsonl's source of it
    (the tokenizer found through model.init_from)."""
    from fleetwise.config.validate import load_config
    from fleetwise.runtime.modeling import build_source

    tmp = tmp_path_factory.mktemp("jsonl")
    hf = tmp / "hf"
    reference = write_hf_model(hf, shard=None)
    tokenizer = write_tokenizer(hf)
    data = write_jsonl(tmp / "train.jsonl", DOCS)
    cfg = load_config(["recipe=llama/tiny", f"model.init_from={hf}", "data=jsonl", f"data.path={data}"])
    return build_source(cfg), by_hand(tokenizer), reference, hf


def test_rows_pack_documents_with_their_positions_and_prompt_labels_masked(packed):
    source, rows, _, _ = packed
    assert [len(r) for r in rows] == [2, 1, 2], "the documents chosen pack as 2 + 1 (cut) + 2"
    assert source.num_samples == len(rows)
    batch = source.batch(torch.arange(len(rows)).numpy())
    for r, row in enumerate(rows):
        tokens, labels, positions = [], [], []
        for ids, p in row:
            tokens += ids[:-1]
            labels += [-100 if j + 1 < p else t for j, t in enumerate(ids[1:])]
            positions += list(range(len(ids) - 1))
        pad = SEQ - len(tokens)
        assert batch["tokens"][r].tolist() == tokens + [EOS] * pad
        assert batch["labels"][r].tolist() == labels + [-100] * pad
        assert batch["positions"][r].tolist() == positions + list(range(pad))


def test_packed_loss_equals_each_document_alone_by_hand(packed):
    """The loss of the packed rows (fleetwise's Llama, positions and document masks) equals the mean
    cross entropy of the response tokens of each document run alone through transformers."""
    import fleetwise
    from fleetwise.models.transformer import lm_loss

    source, rows, reference, hf = packed
    batch = source.batch(torch.arange(len(rows)).numpy())
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for row in rows:
            for ids, p in row:
                logits = reference(torch.tensor([ids[:-1]])).logits[0].double()
                logp = logits - logits.logsumexp(-1, keepdim=True)
                for j, target in enumerate(ids[1:]):
                    if j + 1 >= p:  # the target is not a prompt token
                        total -= logp[j, target]
                        count += 1
        expected = (total / count).item()
        model = fleetwise.load_model(hf)
        got = lm_loss(model(batch["tokens"], batch["positions"]), batch["labels"]).item()
        unmasked = lm_loss(model(batch["tokens"]), batch["labels"]).item()
    assert abs(got - expected) <= 1e-5, (got, expected)
    # the documents' masks and positions matter: one causal sequence per row gives another loss
    assert abs(unmasked - expected) > 1e-2, (unmasked, expected)


def test_bad_lines_are_listed_by_number_and_nothing_starts(tmp_path, packed, capsys):
    from fleetwise.cli import main

    *_, hf = packed
    rows = [{"text": "fine"}, "not json", "", {"text": ""}, {"prompt": "a"}, {"text": 3}, [1, 2]]
    rows += [{"prompt": "a", "response": "b", "text": "c"}, {"id": 7}] + ["{broken"] * 25
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    args = ["recipe=llama/tiny", "data=jsonl", f"data.path={bad}", f"data.tokenizer={hf}"]
    code = main(
        [
            "validate",
            *args,
            "strategy=hybrid",
            "strategy.pp_degree=2",
            "hardware.devices_per_node=2",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and not out["valid"]
    by_line = {e["msg"].split(": ", 1)[0]: e for e in out["errors"] if e["loc"] == "data.path"}
    listed = [f"{bad}:{n}" for n in range(2, 22)]  # the first 20 bad lines, each by number
    assert list(by_line)[:20] == listed
    for n, what in [
        (2, "invalid JSON"),
        (3, "empty line"),
        (4, '"text" is empty'),
        (5, '"response" is missing'),
    ]:
        assert what in by_line[f"{bad}:{n}"]["msg"] and by_line[f"{bad}:{n}"]["hint"]
    assert "of type int" in by_line[f"{bad}:6"]["msg"] and "list" in by_line[f"{bad}:7"]["msg"]
    assert "both" in by_line[f"{bad}:8"]["msg"] and "['id']" in by_line[f"{bad}:9"]["msg"]
    [more] = [e for e in out["errors"] if "more bad lines" in e["msg"]]
    assert "13 more bad lines (of 33 in 34), from line 22" in more["msg"]
    [pp] = [e for e in out["errors"] if e["loc"] == "strategy.pp_degree"]
    assert "pp_degree=2" in pp["msg"] and "strategy.pp_degree=1" in pp["hint"]

    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    assert main(["validate", "recipe=llama/tiny", "data=jsonl", f"data.path={good}", "--json"]) == 2
    [e] = json.loads(capsys.readouterr().out)["errors"]  # no tokenizer: neither data.tokenizer nor init_from
    assert e["loc"] == "data.tokenizer" and "model.init_from" in e["hint"]
    assert (
        main(
            [
                "validate",
                "recipe=llama/tiny",
                "data=jsonl",
                f"data.path={good}",
                "model.vocab_size=64",
                f"data.tokenizer={hf / 'tokenizer.json'}",
                "--json",
            ]
        )
        == 2
    )
    [e] = json.loads(capsys.readouterr().out)["errors"]
    assert e["loc"] == "model.vocab_size" and "120 tokens" in e["msg"] and "model.vocab_size=120" in e["hint"]


def test_with_the_launchers_index_a_rank_reads_only_its_rows_lines(tmp_path, packed):
    """The launcher's packing index (run directory) tells a rank where its rows' lines are: with
    every other line garbled in place (same size and time), row 1 still reads; a source without the
    index builds one from the whole file and meets the garbled line."""
    import os

    from fleetwise.config.validate import load_config
    from fleetwise.data.jsonl import write_index
    from fleetwise.rundir import DATA_INDEX_FILE
    from fleetwise.runtime.modeling import build_source

    source, *_, hf = packed
    expected = source.batch(torch.arange(3).numpy())
    data = write_jsonl(tmp_path / "train.jsonl", DOCS)
    args = ["recipe=llama/tiny", f"model.init_from={hf}", "data=jsonl", f"data.path={data}"]
    cfg, plain = load_config([*args, f"run.dir={tmp_path / 'run'}"]), load_config(args)  # before the garbling
    (tmp_path / "run").mkdir()
    write_index(tmp_path / "run" / DATA_INDEX_FILE, cfg.data, cfg.model.init_from, cfg.model.seq_len)
    before = data.stat()
    lines = data.read_bytes().split(b"\n")
    data.write_bytes(b"\n".join(x if i == 2 else b"#" * len(x) for i, x in enumerate(lines)))  # row 1: line 3
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    row = build_source(cfg).batch(torch.tensor([1]).numpy())
    for key in ("tokens", "labels", "positions"):
        assert torch.equal(row[key][0], expected[key][1]), key
    with pytest.raises(ValueError, match=r"train.jsonl:1: invalid JSON"):
        build_source(plain).batch(torch.tensor([1]).numpy())
