"""`zoo prepare chats`: built-in conversations for trying supervised fine-tuning with no download.

``arithmetic``: a user asks for a sum, difference or product of two small numbers (sometimes a
second question in the same conversation, sometimes under a system message) and the assistant
answers with the number: a task a tiny model learns in minutes, whose answers a script can check.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from zoo.errors import UsageError, at_least_one

_OPS = (("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b))


def arithmetic(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` conversations in the chat format (`zoo.data.sft`), the same for the same seed."""
    rng = np.random.default_rng(seed)

    def turn() -> list[dict[str, str]]:
        a, b = (int(x) for x in rng.integers(0, 20, 2))
        word, fn = _OPS[int(rng.integers(len(_OPS)))]
        return [{"role": "user", "content": f"What is {a} {word} {b}?"}, {"role": "assistant", "content": str(fn(a, b))}]

    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": "Answer with the number only."}] if rng.random() < 0.2 else []
        for _ in range(2 if rng.random() < 0.25 else 1):
            messages += turn()
        out.append({"messages": messages})
    return out


def cmd_prepare_chats(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if out.suffix != ".jsonl":
        raise UsageError(f"{out}: the conversations file must end in .jsonl (data.path selects the sft dataset by it)")
    if out.exists() and not args.force_overwrite:
        raise UsageError(f"{out} exists; nothing was overwritten (--force-overwrite replaces it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in arithmetic(args.count, args.seed):
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}: {args.count:,} conversations ({args.dataset})")
    return 0


def add_prepare_parser(prep: Any) -> None:
    c = prep.add_parser("chats", help="built-in conversations (.jsonl) to fine-tune on: docs/sft.md")
    c.add_argument("output", help="the .jsonl file to write")
    c.add_argument("--dataset", choices=["arithmetic"], default="arithmetic",
                   help="arithmetic: 'What is 4 plus 7?' -> '11' (sums, differences, products of 0-19)")
    c.add_argument("--count", type=at_least_one, default=5000, help="conversations")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--force-overwrite", action="store_true")
    c.set_defaults(func=cmd_prepare_chats)
