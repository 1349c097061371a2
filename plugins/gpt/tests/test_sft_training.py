"""Supervised fine-tuning through `zoo train` and `zoo generate --chat`: a ``.jsonl`` path selects
the sft dataset, two data-parallel ranks follow one process's curve, fine-tuning starts from a run
directory's weights, the answer is learned, and the checkpoint carries the chat template it learned."""

from __future__ import annotations

import json

import pytest
from _gpt_helpers import curve, ranks, small_run, zoo


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """One fixed answer a prompt: "colour of X?" -> X's colour (16 prompts), as chat messages and pairs."""
    from zoo.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("sft")
    colours = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow",
               "plum": "purple", "orange": "orange", "sea": "teal", "rose": "pink", "ash": "grey", "sand": "beige",
               "cream": "ivory", "wine": "maroon", "gold": "amber", "mint": "jade"}
    rows = []
    for i in range(12):
        for thing, colour in colours.items():
            rows.append({"messages": [{"role": "user", "content": f"colour of {thing}?"},
                                      {"role": "assistant", "content": colour}]} if i % 2 else
                        {"prompt": f"colour of {thing}?", "completion": colour})
    (root / "chat.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    texts = [f"<|user|> colour of {t}? <|assistant|> {c}" for t, c in colours.items()] * 30
    train_bpe(texts, 600, special_tokens=["<|endoftext|>"]).save(root)  # (tokenizer.json alone: zoo's template)
    return root


def test_sft_run_on_two_ranks_follows_one_process_and_learns_the_answers(chats, tmp_path, corpus_cache):
    args = (f"data.path={chats / 'chat.jsonl'}", f"data.tokenizer={chats}", "model.vocab_size=600",
            "train.global_batch_size=8", "train.micro_batch_size=2", "optimizer.lr=3e-3", "data.split=100,0,0",
            "schedule.warmup_steps=5")
    one = zoo(*small_run(tmp_path / "one", corpus_cache, *args, "train.steps=8"))
    assert one.returncode == 0, one.stderr
    assert "on sft to step 8" in one.stdout  # (the .jsonl path chose the dataset)
    two = ranks(2, *small_run(tmp_path / "two", corpus_cache, *args, "train.steps=8"))
    assert two.returncode == 0, two.stdout + two.stderr
    assert curve(tmp_path / "two") == pytest.approx(curve(tmp_path / "one"), rel=1e-5)
    # fine-tuning goes on from the first run's weights (a run directory names its newest checkpoint)
    more = zoo(*small_run(tmp_path / "more", corpus_cache, *args, "train.steps=120", "optimizer.lr=5e-3",
                          f"checkpoint.load={tmp_path / 'one'}"))
    assert more.returncode == 0, more.stderr
    losses = curve(tmp_path / "more")
    assert losses[0] < curve(tmp_path / "one")[0] - 0.5 and losses[-1] < 0.1
    ckpt = next((tmp_path / "more" / "checkpoints").glob("step_*"))
    assert "<|assistant|>" in (ckpt / "chat_template.jinja").read_text()  # zoo's template, kept for --chat
    answers = {}
    for thing in ("sky", "coal", "mint"):
        out = zoo("generate", "--checkpoint", str(tmp_path / "more"), "--chat", "--prompt", f"colour of {thing}?",
                  "--greedy", "--max-new-tokens", "6")
        assert out.returncode == 0, out.stderr
        answers[thing] = out.stdout.strip()
    assert answers == {"sky": "blue", "coal": "black", "mint": "jade"}
