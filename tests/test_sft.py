"""The ``sft`` dataset (zoo.data.sft): which tokens are learned against transformers'
``apply_chat_template(return_assistant_tokens_mask=True)``, packing against the conversations it
packs, the batch stream (resume, data-parallel slices), a packed row's loss against each conversation
run alone, and the errors a user's file can cause."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zoo.data import sft
from zoo.data.tokenizer import load_tokenizer
from zoo.errors import ConfigError, UsageError

# ChatML with the answers (their end-of-turn included) marked for transformers' assistant mask
TAGGED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
UNTAGGED = TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse abc"},
     {"role": "assistant", "content": "cba"}, {"role": "user", "content": "add 4 7"},
     {"role": "assistant", "content": "11 é, ok"}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": " world  how are you"}],
    [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = ["hello world how are you", "reverse abc cba", "add 4 7 gives 11", "be brief, say nothing"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=TAGGED).save_pretrained(out)
    return out


@pytest.mark.parametrize("template", ["tagged", "untagged"])
def test_learned_tokens_equal_transformers_assistant_mask(tok_dir, template, tmp_path):
    """Token ids and learned tokens equal transformers' rendering and assistant mask (from the tagged
    template): read from the template's {% generation %} blocks, or, untagged, from rendering each
    answer's beginning and end (the same spans)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    (tmp_path / "t.jinja").write_text(UNTAGGED)
    source, special = sft.template_source(str(tok_dir), None if template == "tagged" else str(tmp_path / "t.jinja"))
    assert ("{% generation %}" in source) == (template == "tagged")
    render, tok = sft.Renderer(source, **special), load_tokenizer(tok_dir)
    for conv in CONVERSATIONS:
        want = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, learned = sft.encode(tok, *render(conv))
        assert ids.tolist() == want["input_ids"]
        assert learned.astype(int).tolist() == want["assistant_masks"]
        assert learned.any()


def test_zoo_template_where_the_tokenizer_has_none(tmp_path):
    """A tokenizer without a chat template (zoo's own BPE: a tokenizer.json alone) renders with zoo's
    plain template: the learned tokens of each answer spell its text and the end-of-document token."""
    from zoo.data.tokenizer import train_bpe

    tok = train_bpe(["reverse abc cba add 4 7 11"] * 50, 300, special_tokens=["<|endoftext|>"])
    tok.save(tmp_path)
    source, special = sft.template_source(str(tmp_path / "tokenizer.json"), None)
    assert source == sft.ZOO_TEMPLATE
    special["eos_token"] = tok.backend.id_to_token(tok.eod_id)
    render = sft.Renderer(source, **special)
    ids, learned = sft.encode(tok, *render(CONVERSATIONS[0]))
    pieces, run = [], []
    for i, flag in zip(ids, learned):
        if flag:
            run.append(int(i))
        elif run:
            pieces.append(tok.decode(run))
            run = []
    pieces += [tok.decode(run)] if run else []
    assert pieces == ["cba<|endoftext|>", "11 é, ok<|endoftext|>"]
    # bytes: one token a byte, the same spans
    ids_b, learned_b = sft.encode(load_tokenizer("bytes"), *render(CONVERSATIONS[0]))
    assert bytes(ids_b[learned_b].tolist()).decode() == "cba<|endoftext|>11 é, ok<|endoftext|>"


def _conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        word = "".join(rng.choice(list("abcdefgh"), int(rng.integers(1, 12))))
        rows.append({"prompt": f"reverse {word}", "completion": word[::-1]} if i % 2 else
                    {"messages": [{"role": "user", "content": f"say {word}"}, {"role": "assistant", "content": word}]})
    return rows


def _run(path, tok_dir, **train):
    data = SimpleNamespace(path=str(path), train_path=None, valid_path=None, tokenizer=str(tok_dir),
                           chat_template=None, split="90,10,0", cache_dir=None)
    t = SimpleNamespace(**{"seq_length": 32, "seed": 3, "micro_batch_size": 2, "global_batch_size": 8,
                           "rampup_batch_size": None, **train})
    return SimpleNamespace(data=data, train=t, model=SimpleNamespace(vocab_size=300))


def test_packing_keeps_every_conversation_once_and_whole(tok_dir, tmp_path):
    """Each conversation's (input, label, learned) pairs appear once, contiguous, positions from 0
    and a sample id of their own; rows hold at most seq_length pairs, padding out of the loss;
    conversations longer than a row are cut to it and counted."""
    rows = _conversations(60)
    rows[7] = {"prompt": "reverse " + "abcdefgh" * 16, "completion": "hgfedcba" * 16}  # longer than a row
    (tmp_path / "c.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n\n")  # (a blank line is skipped)
    run = _run(tmp_path / "c.jsonl", tok_dir, seq_length=128)
    packed = sft.load_split(run, "train")
    tok, (source, special) = load_tokenizer(tok_dir), sft.template_source(str(tok_dir), None)
    render = sft.Renderer(source, **special)
    expected = [sft.encode(tok, *render(sft._messages(r, "x"))) for r in rows[:54]]  # split 90,10
    found = []
    for r in range(len(packed)):
        seg = packed.segment_ids[r]
        for s in np.unique(seg[seg >= 0]):
            at = np.nonzero(seg == s)[0]
            assert (np.diff(at) == 1).all() and (packed.position_ids[r, at] == np.arange(len(at))).all()
            found.append((packed.tokens[r, at].tolist(), packed.labels[r, at].tolist(), packed.loss_mask[r, at].tolist()))
        assert (packed.loss_mask[r, seg < 0] == 0).all()
    want = [(ids[:-1][:128].tolist(), ids[1:][:128].tolist(), learned[1:][:128].astype(np.float32).tolist())
            for ids, learned in expected]
    assert sorted(found) == sorted(want)
    assert packed.truncated == sum(len(ids) - 1 > 128 for ids, _ in expected) == 1
    assert len(packed) < len(expected) / 1.5  # (rows hold several conversations)
    valid = sft.load_split(run, "valid")
    assert valid.conversations == 6
    assert sft.load_split(run, "train").tokens.tobytes() == packed.tokens.tobytes()  # (from the cache)


def test_batch_stream_resumes_and_splits_over_ranks(tok_dir, tmp_path):
    """Batch k of a stream started after c samples is batch k + c / gbs of one started at 0; the
    data-parallel ranks' micro-batches are the single rank's global batch, in halves; a new epoch
    reorders the rows."""
    import itertools

    (tmp_path / "c.jsonl").write_text("\n".join(map(json.dumps, _conversations(80))) + "\n")
    run = _run(tmp_path / "c.jsonl", tok_dir, seq_length=128)

    def take(n, **kw):
        return [b["tokens"] for b in itertools.islice(sft.build(run, split="train", **kw), n)]

    one = take(40, dp_rank=0, dp_size=1)
    assert all(torch.equal(a, b) for a, b in zip(take(20, dp_rank=0, dp_size=1, consumed_samples=40), one[20:]))
    ranks = [take(20, dp_rank=r, dp_size=2) for r in (0, 1)]
    for step in range(10):  # a global batch of 8: 4 micro-batches of 2 on one rank, 2 on each of two
        assert torch.equal(torch.cat(one[4 * step:4 * step + 4]),
                           torch.cat(ranks[0][2 * step:2 * step + 2] + ranks[1][2 * step:2 * step + 2]))
    n = len(sft.load_split(run, "train"))
    rows = torch.cat(one)
    assert len(rows) >= 2 * n and not torch.equal(rows[:n], rows[n:2 * n])
    assert sorted(map(tuple, rows[:n].tolist())) == sorted(map(tuple, rows[n:2 * n].tolist()))


def test_a_packed_row_loses_what_its_conversations_lose_alone(tok_dir, tmp_path):
    """The loss of a packed micro-batch (positions restarting, attention kept inside each
    conversation, only answers counted) equals the cross entropy of each conversation run through
    the model on its own, over its learned tokens."""
    import dataclasses

    from zoo_gpt import plugin
    from zoo_gpt.model import build

    (tmp_path / "c.jsonl").write_text("\n".join(map(json.dumps, _conversations(40))) + "\n")
    run = _run(tmp_path / "c.jsonl", tok_dir, seq_length=48)
    batch = next(sft.build(run, split="train", dp_rank=0, dp_size=1))
    torch.manual_seed(0)
    model = build(dataclasses.replace(plugin.llama_tiny(), vocab_size=300), plugin.LLAMA).double().eval()
    with torch.no_grad():
        got = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                    position_ids=batch["position_ids"], segment_ids=batch["segment_ids"])
        total, count = 0.0, 0.0
        for r in range(len(batch["tokens"])):
            seg = batch["segment_ids"][r]
            for s in seg[seg >= 0].unique():
                at = (seg == s).nonzero().flatten()
                logits = model(batch["tokens"][r, at][None])[0]
                ce = torch.nn.functional.cross_entropy(logits, batch["labels"][r, at], reduction="none")
                total += float((ce * batch["loss_mask"][r, at]).sum())
                count += float(batch["loss_mask"][r, at].sum())
    assert count > 20 and abs(got.item() - total / count) < 1e-6  # (the loss is summed in float32)


def test_bad_input_names_the_line_and_the_fix(tok_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    for text, match in [
        ('{"prompt": "a", "completion": "b"}\n{"prompt": "a"\n', r"bad.jsonl:2: not JSON"),
        ('{"messages": [{"role": "robot", "content": "x"}]}\n', r"bad.jsonl:1: each message needs a 'role'"),
        ('{"messages": [{"role": "user", "content": "x"}]}\n', r"bad.jsonl:1: no assistant message"),
        ('{"question": "a", "answer": "b"}\n', r"bad.jsonl:1: expected 'messages', or 'prompt' and 'completion'"),
        ("\n", r"no conversations"),
    ]:
        bad.write_text(text)
        with pytest.raises(UsageError, match=match):
            sft.conversations(bad)
    (tmp_path / "c.jsonl").write_text("\n".join(map(json.dumps, _conversations(20))) + "\n")
    with pytest.raises(ConfigError, match="data.path: .*missing.jsonl: no such file"):
        sft.load_split(_run(tmp_path / "missing.jsonl", tok_dir), "train")
    run = _run(tmp_path / "c.jsonl", tok_dir)
    run.data.tokenizer = None
    with pytest.raises(ConfigError, match="set data.tokenizer"):
        sft.load_split(run, "train")
    run = _run(tmp_path / "c.jsonl", tok_dir)
    sft.load_split(run, "train")  # (cached: the model's vocabulary is checked against cached rows too)
    run.model.vocab_size = 100
    with pytest.raises(ConfigError, match="beyond model.vocab_size=100"):
        sft.load_split(run, "train")
    # a template whose rendering of a conversation's beginning is not the whole's beginning
    (tmp_path / "odd.jinja").write_text("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    run = _run(tmp_path / "c.jsonl", tok_dir)
    run.data.chat_template = str(tmp_path / "odd.jinja")
    with pytest.raises(UsageError, match="mark them with {% generation %}"):
        sft.load_split(run, "train")
    # templates run in Jinja's sandbox: no attribute of Python's internals reaches them
    (tmp_path / "evil.jinja").write_text("{{ messages.__class__.__mro__ }}")
    run.data.chat_template = str(tmp_path / "evil.jinja")
    with pytest.raises(Exception, match="unsafe|access"):
        sft.load_split(run, "train")


def test_families_that_cannot_keep_packed_documents_apart_are_refused():
    """Packed conversations (or Megatron's reset_attention_mask) need a model that reads segment_ids:
    the GPT and MoE families do, Mamba's does not (its state would run on from one conversation into
    the next) and is refused; token data for a diffusion family is refused too; the ramp-up reads sft."""
    import zoo
    from zoo.family import check_dataset
    from zoo.registry import get_registry

    sft_spec, megatron = get_registry().dataset("sft")[0], get_registry().dataset("megatron")[0]
    run = SimpleNamespace(data=SimpleNamespace(reset_attention_mask=False),
                          train=SimpleNamespace(rampup_batch_size=[8, 8, 64], cuda_graph=False))
    for name in ("llama", "gemma2", "mixtral"):
        check_dataset(zoo.get_family(name), sft_spec, run)
    check_dataset(zoo.get_family("mamba2"), megatron, run)
    with pytest.raises(ConfigError, match="packed documents \\(dataset sft\\): family 'mamba2' keeps no packed documents apart"):
        check_dataset(zoo.get_family("mamba2"), sft_spec, run)
    run.data.reset_attention_mask = True
    with pytest.raises(ConfigError, match="data.reset_attention_mask: family 'mamba2'"):
        check_dataset(zoo.get_family("mamba2"), megatron, run)
    with pytest.raises(ConfigError, match="family 'dit' \\(task diffusion\\)"):
        check_dataset(zoo.get_family("dit"), sft_spec, run)


def test_data_info_preview_and_lint_of_a_conversations_file(tok_dir, tmp_path, capsys):
    """`zoo data info FILE.jsonl` counts conversations, messages, tokens (learned ones apart) and the
    rows they pack into; `zoo data preview` shows what is learned; `zoo data lint` lists every bad
    line and exits 1."""
    from zoo.cli import main

    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"messages": c}) for c in CONVERSATIONS) + "\n")
    assert main(["data", "info", str(good), "--tokenizer", str(tok_dir), "--seq-length", "64"]) == 0
    out = capsys.readouterr().out
    tok, (source, special) = load_tokenizer(tok_dir), sft.template_source(str(tok_dir), None)
    render = sft.Renderer(source, **special)
    encoded = [sft.encode(tok, *render(c)) for c in CONVERSATIONS]
    total, learned = sum(len(i) for i, _ in encoded), sum(int(m.sum()) for _, m in encoded)
    assert "3 conversations (sft), messages: 4 assistant, 1 system, 4 user" in out
    assert f"tokens: {total:,} ({learned:,} learned)" in out and "seq_length 64: " in out
    # preview: the rendering, learned token runs decoded between ⟦ and ⟧
    assert main(["data", "preview", str(good), "--tokenizer", str(tok_dir), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "⟦cba<|im_end|>\n⟧" in out and "⟦11 é, ok<|im_end|>\n⟧" in out and "reverse abc" in out
    assert f"({len(encoded[0][0])} tokens, {int(encoded[0][1].sum())} learned)" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"oops\n{"messages": [{"role": "user", "content": "x"}]}\n')
    assert main(["data", "lint", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad.jsonl:2: not JSON" in out and "bad.jsonl:3: no assistant message" in out
    assert "3 lines checked, 2 problem(s)" in out


def test_prepare_chats_writes_checkable_conversations(tmp_path, capsys):
    """`zoo prepare chats`: conversations the sft dataset reads, every answer the arithmetic of its
    question, the same file for the same seed; an existing file is kept."""
    import re

    from zoo.cli import main

    out = tmp_path / "c.jsonl"
    assert main(["prepare", "chats", str(out), "--count", "300", "--seed", "1"]) == 0
    convs = sft.conversations(out)
    assert len(convs) == 300 and any(len(c) > 2 for c in convs) and any(c[0]["role"] == "system" for c in convs)
    ops = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
    for c in convs:
        turns = [m for m in c if m["role"] != "system"]
        for q, a in zip(turns[::2], turns[1::2]):
            x, op, y = re.fullmatch(r"What is (\d+) (plus|minus|times) (\d+)\?", q["content"]).groups()
            assert a["role"] == "assistant" and int(a["content"]) == ops[op](int(x), int(y))
    first = out.read_bytes()
    assert main(["prepare", "chats", str(out), "--count", "300", "--seed", "1"]) == 2  # (kept)
    assert main(["prepare", "chats", str(out), "--count", "300", "--seed", "1", "--force-overwrite"]) == 0
    assert out.read_bytes() == first
    assert main(["prepare", "chats", str(tmp_path / "c.json")]) == 2
    assert "must end in .jsonl" in capsys.readouterr().err


def test_best_fit_packing_against_a_brute_force_search():
    """`pack` puts each conversation where it leaves the least room (the oldest such row), as a
    search over every row does; every item once, no row over its capacity, and a large set fast."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 3000).tolist()
    rows, room = [], []
    for i, n in enumerate(lengths):  # the reference: look at every row
        fits = [(free, r) for r, free in enumerate(room) if free >= n]
        if fits:
            free, r = min(fits)
            rows[r].append(i)
            room[r] -= n
        else:
            rows.append([i])
            room.append(64 - n)
    assert sft.pack(lengths, 64) == rows
    big = rng.integers(20, 1500, 200_000).tolist()
    packed = sft.pack(big, 4096)
    assert sorted(i for r in packed for i in r) == list(range(len(big)))
    assert max(sum(big[i] for i in r) for r in packed) <= 4096 and sum(big) / (len(packed) * 4096) > 0.99
