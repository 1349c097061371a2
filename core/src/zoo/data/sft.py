"""Supervised fine-tuning data (the ``sft`` dataset): conversations from JSON-lines files, rendered by
the tokenizer's chat template, the loss on the assistant's tokens only, packed into sequences.

Each line is one conversation: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (the chat
format of Hugging Face and OpenAI), or a pair ``{"prompt": ..., "completion": ...}`` (also
``input`` / ``output``, NeMo's names; an optional ``system``), which is a user and an assistant
message. The template is ``data.chat_template`` (a Jinja file), else the tokenizer directory's own
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``), else `ZOO_TEMPLATE`. It is
rendered in Jinja's sandbox (templates are data; nothing they hold runs as Python).

Which tokens are learned: the characters of a template's ``{% generation %}`` blocks where it marks
them (as transformers' ``return_assistant_tokens_mask`` reads them), otherwise each assistant
message's own characters as rendering shows them, from the end of the conversation before it (with
the generation prompt) to the end of the conversation through it, its end-of-turn text included. A
token is learned when its characters start inside such a span (transformers' rule: the tokens
holding a span's first and last characters and those between).

Packing: each conversation of n tokens gives n - 1 (input, label) pairs; conversations (shuffled with
``train.seed``) fill rows of ``train.seq_length`` pairs best-fit, each keeping its own positions
(from 0) and attention (``segment_ids``); a row's unused tail is padding, out of the loss. A
conversation longer than a row is cut to it (counted and reported). Rows are drawn in a new
shuffled order every epoch; sample g of the stream is row ``order(g // rows)[g % rows]``, so a run
resumed at any step reads what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zoo.errors import ConfigError, UsageError

# The template for tokenizers without one: role lines, the assistant's turn ended by the tokenizer's
# end-of-document token (what the model learns to stop with). (Templates render with trim_blocks, as
# transformers renders them: a newline right after a block tag is dropped, so it is written as an
# expression.)
ZOO_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")
_START, _END = "\ue000", "\ue001"  # (private-use characters: where a generation block starts and ends)


def conversations(path: str | os.PathLike[str]) -> list[list[dict[str, str]]]:
    """The conversations of one JSON-lines file, each a list of ``{"role", "content"}`` messages;
    the first problem raises, naming its line."""
    convs, problems = read(path, stop_at_first=True)
    if problems:
        raise UsageError(problems[0])
    return convs


def read(path: str | os.PathLike[str], *, stop_at_first: bool = False) -> tuple[list[list[dict[str, str]]], list[str]]:
    """(the conversations, a line for each problem) of one JSON-lines file (`zoo data lint`)."""
    out, problems = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{where}: not JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
                out.append(_messages(row, where))
            except UsageError as e:
                problems.append(str(e))
                if stop_at_first:
                    break
    if not out and not problems:
        problems.append(f"{path}: no conversations")
    return out, problems


def _messages(row: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(row, dict):
        raise UsageError(f"{where}: a conversation is a JSON object, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UsageError(f"{where}: 'messages' must be a non-empty list")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise UsageError(f"{where}: each message needs a 'role' ({', '.join(ROLES)}) and a string "
                                 f"'content', got {json.dumps(m)[:120]}")
        out = [{"role": m["role"], "content": m["content"]} for m in msgs]
    else:
        for prompt, answer in (("prompt", "completion"), ("input", "output")):
            if isinstance(row.get(prompt), str) and isinstance(row.get(answer), str):
                break
        else:
            raise UsageError(f"{where}: expected 'messages', or 'prompt' and 'completion' (or 'input' and "
                             f"'output') strings; keys: {sorted(row)}")
        system = row.get("system")
        out = ([{"role": "system", "content": system}] if isinstance(system, str) else []) + [
            {"role": "user", "content": row[prompt]}, {"role": "assistant", "content": row[answer]}]
    if not any(m["role"] == "assistant" for m in out):
        raise UsageError(f"{where}: no assistant message: nothing to learn")
    if any(_START in m["content"] or _END in m["content"] for m in out):
        raise UsageError(f"{where}: a message holds U+E000 or U+E001 (reserved for marking answers)")
    return out


# ------------------------------------------------------------------------------------ templates


def _environment() -> Any:
    """Jinja's immutable sandbox with what chat templates expect (transformers' additions): the
    ``{% generation %}`` block, ``raise_exception``, ``tojson`` and ``strftime_now``."""
    import datetime

    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _START + caller() + _END

    def raise_exception(message: str) -> None:
        raise UsageError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def template_source(tokenizer_dir: str | None, chat_template: str | None) -> tuple[str, dict[str, Any]]:
    """(the Jinja source, the special tokens it is rendered with) for this run."""
    from zoo.data.tokenizer import tokenizer_path

    config: dict[str, Any] = {}
    directory = tokenizer_path(tokenizer_dir) if tokenizer_dir else None
    if directory is not None and directory.is_file() and directory.name == "tokenizer.json":
        directory = directory.parent
    directory = directory if directory is not None and directory.is_dir() else None
    if directory is not None and (directory / "tokenizer_config.json").is_file():
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
    if chat_template == "zoo":
        return ZOO_TEMPLATE, tokens
    if chat_template is not None:
        try:
            return Path(chat_template).read_text(encoding="utf-8"), tokens
        except OSError as e:
            raise ConfigError(f"data.chat_template={chat_template!r}: {e.strerror}") from None
    if directory is not None and (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8"), tokens
    own = config.get("chat_template")
    if isinstance(own, list):  # named templates: the default one
        own = next((t.get("template") for t in own if isinstance(t, dict) and t.get("name") == "default"), None)
    return (own, tokens) if isinstance(own, str) else (ZOO_TEMPLATE, tokens)


class Renderer:
    """A conversation -> (text, the character spans of what is learned)."""

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None) -> None:
        from jinja2 import TemplateError

        try:
            self.template = _environment().from_string(source)
        except TemplateError as e:
            raise ConfigError(f"chat template: {e}") from None
        self.tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self.marked = re.search(r"{%-?\s*generation\s*-?%}", source) is not None

    def _render(self, messages: list[dict[str, str]], prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=prompt, **self.tokens)

    def __call__(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        text = self._render(messages, False)
        if self.marked:  # the template's own generation blocks
            spans, plain, start = [], [], 0
            for piece in text.split(_START):
                body, _, rest = piece.partition(_END) if _END in piece else ("", "", piece)
                if body:
                    spans.append((start, start + len(body)))
                plain.append(body + rest)
                start += len(body) + len(rest)
            return "".join(plain), spans
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, through = self._render(messages[:i], True), self._render(messages[:i + 1], False)
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise UsageError("the chat template does not render a conversation's beginning as the beginning of "
                                 "the whole, so its answers cannot be found; mark them with {% generation %} "
                                 "blocks or set data.chat_template")
            spans.append((len(before), len(through)))
        return text, spans


# ----------------------------------------------------------------------------------- tokenizing


def encode(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, learned) of a rendered conversation: a token is learned when it lies between the
    tokens holding a span's first and last characters (transformers' ``char_to_token`` rule)."""
    if tokenizer.backend is None:  # bytes: one token a byte
        data = text.encode("utf-8")
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        starts = np.cumsum([0] + [len(c.encode("utf-8")) for c in text])
        spans = [(int(starts[a]), int(starts[b])) for a, b in spans]
        offsets = np.stack([np.arange(len(data)), np.arange(1, len(data) + 1)], 1)
    else:
        enc = tokenizer.backend.encode(text, add_special_tokens=False)
        ids, offsets = np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    learned = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        if b <= a:
            continue
        holds = np.nonzero((offsets[:, 0] <= b - 1) & (offsets[:, 1] > a) & (offsets[:, 1] > offsets[:, 0]))[0]
        if len(holds):
            learned[holds[0]:holds[-1] + 1] = True
    return ids, learned


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit: each item (in order) goes into the row it fills most tightly (the one whose room is
    the least that holds it; among equals the oldest), else a new row. The rows' rooms stay in a
    sorted list: a bisection a conversation (200,000 of them into 20,000 rows: about a second)."""
    import bisect

    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row), sorted
    for i, n in enumerate(lengths):
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, r = room.pop(at)
            rows[r].append(i)
        else:
            free, r = capacity, len(rows)
            rows.append([i])
        if free - n > 0:
            bisect.insort(room, (free - n, r))
    return rows


class Packed:
    """The packed rows of one split: tokens, labels, loss mask, positions and sample ids, each
    (rows, seq_length) (`FIELDS`: a micro-batch's keys)."""

    FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")

    def save(self, path: Path) -> None:
        """Written to a temporary name and renamed (the cache)."""
        tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, truncated=self.truncated, conversations=self.conversations,
                 **{f: getattr(self, f) for f in self.FIELDS})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Packed:
        packed = cls.__new__(cls)
        with np.load(path) as z:
            for f in cls.FIELDS:
                setattr(packed, f, z[f])
            packed.truncated, packed.conversations = int(z["truncated"]), int(z["conversations"])
        return packed

    def __init__(self, ids: list[np.ndarray], learned: list[np.ndarray], seq: int, pad: int, seed: int) -> None:
        order = np.random.default_rng(seed).permutation(len(ids))
        pairs = [min(len(ids[i]) - 1, seq) for i in order]
        self.truncated = sum(len(ids[i]) - 1 > seq for i in order)
        rows = pack(pairs, seq)
        n = len(rows)
        self.tokens = np.full((n, seq), pad, dtype=np.int64)
        self.labels = np.full((n, seq), pad, dtype=np.int64)
        self.loss_mask = np.zeros((n, seq), dtype=np.float32)
        self.position_ids = np.zeros((n, seq), dtype=np.int64)
        self.segment_ids = np.full((n, seq), -1, dtype=np.int64)  # padding: a sample of its own
        for r, members in enumerate(rows):
            at = 0
            for s, j in enumerate(members):
                i, k = order[j], pairs[j]
                self.tokens[r, at:at + k] = ids[i][:k]
                self.labels[r, at:at + k] = ids[i][1:k + 1]
                self.loss_mask[r, at:at + k] = learned[i][1:k + 1]
                self.position_ids[r, at:at + k] = np.arange(k)
                self.segment_ids[r, at:at + k] = s
                at += k
        self.conversations = len(ids)

    def __len__(self) -> int:
        return len(self.tokens)


def tokenizer_dir(run: Any) -> Path | None:
    """The tokenizer stored with checkpoints, the run's chat template in it as ``chat_template.jinja``
    (whichever was used: a file, the tokenizer's own or zoo's), so that ``zoo generate --chat`` asks as
    training answered. A copy in the data cache when the template is not the tokenizer's own file."""
    from zoo.checkpoint.tensorio import copy_tokenizer_files
    from zoo.data.tokenizer import tokenizer_path

    t = tokenizer_path(run.data.tokenizer) if run.data.tokenizer else None
    if t is not None and t.is_file() and t.name == "tokenizer.json":
        t = t.parent  # (a checkpoint's: its directory holds the rest, e.g. tokenizer_config.json)
    if t is None or not t.is_dir():
        return None
    source, _ = template_source(str(t), run.data.chat_template)
    if (t / "chat_template.jinja").is_file() and (t / "chat_template.jinja").read_text(encoding="utf-8") == source:
        return t
    files = _files(run.data.path or run.data.train_path)
    cache = Path(run.data.cache_dir) if run.data.cache_dir else Path(files[0]).parent / "cache"
    digest = hashlib.sha256(source.encode() + b"".join(
        (t / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json") if (t / n).is_file()))
    out = cache / f"sft-tokenizer-{digest.hexdigest()[:16]}"
    if not out.is_dir():
        tmp = cache / f"{out.name}.tmp{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        copy_tokenizer_files(t, tmp)
        (tmp / "chat_template.jinja").write_text(source, encoding="utf-8")
        try:
            os.replace(tmp, out)
        except OSError:  # (another rank put it there first)
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def chat_prompt(tokenizer: Any, tokenizer_source: str | None, chat_template: str | None, text: str
                ) -> tuple[list[int], int]:
    """(token ids, end-of-turn id) of ``text`` asked as a user message, rendered by the chat template
    (`template_source`) with the generation prompt after it: what `zoo generate --chat` continues."""
    source, special = template_source(tokenizer_source, chat_template)
    backend = tokenizer.backend
    if special.get("eos_token") is None and backend is not None:
        special["eos_token"] = backend.id_to_token(tokenizer.eod_id)
    render = Renderer(source, **special)
    prompt = render.template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                                    **render.tokens).replace(_START, "").replace(_END, "")
    if backend is None:
        return list(prompt.encode("utf-8")), tokenizer.eod_id
    end = backend.token_to_id(special["eos_token"]) if special.get("eos_token") else None
    return backend.encode(prompt, add_special_tokens=False).ids, tokenizer.eod_id if end is None else end


def _files(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def load_split(run: Any, split: str) -> Packed:
    """The packed rows of ``split``: data.<split>_path's conversations, or data.path's divided by
    data.split (in file order, as Megatron divides documents), cached beside the first file."""
    from zoo.data.megatron import file_lock
    from zoo.data.tokenizer import load_tokenizer

    d = run.data
    if not d.tokenizer:
        raise ConfigError("data.dataset=sft: set data.tokenizer (the model's tokenizer directory: its chat "
                          "template and end-of-document token are used too)")
    own = getattr(d, f"{split}_path", None)
    files = _files(own or d.path)
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"data.{split + '_' if own else ''}path: {f}: no such file")
    tok = load_tokenizer(d.tokenizer)
    source, special = template_source(d.tokenizer, d.chat_template)
    if special.get("eos_token") is None and tok.backend is not None:
        special["eos_token"] = tok.backend.id_to_token(tok.eod_id)
    key = hashlib.sha256(json.dumps([
        [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files], source, special, tok.source,
        _file_digest(tok.source), split, None if own else d.split, run.train.seq_length, run.train.seed]).encode())
    cache = Path(d.cache_dir) if d.cache_dir else Path(files[0]).parent / "cache"
    path = cache / f"sft-{key.hexdigest()[:20]}.npz"
    with file_lock(cache / "sft.lock"):
        built = not path.is_file()
        packed = _build(files, own, d, split, run.train, source, special, tok) if built else Packed.load(path)
        if built:
            packed.save(path)
    top = int(packed.tokens.max(initial=0))  # (checked on cached rows too: the model is not in the key)
    if top >= run.model.vocab_size:
        raise ConfigError(f"data.tokenizer {d.tokenizer!r} has ids up to {top}, beyond model.vocab_size="
                          f"{run.model.vocab_size}")
    if built and packed.truncated:
        print(f"zoo: sft {split}: {packed.truncated} of {packed.conversations} conversations cut to "
              f"train.seq_length={run.train.seq_length} tokens", file=sys.stderr)
    return packed


def _build(files: list[str], own: Any, d: Any, split: str, train: Any, source: str, special: dict[str, Any],
           tok: Any) -> Packed:
    from zoo.data.gpt import split_ranges

    convs = [c for f in files for c in conversations(f)]
    if not own:
        rng = split_ranges(d.split, len(convs))[split]
        if rng is None or rng[0] == rng[1]:
            raise ConfigError(f"data.split={d.split!r} leaves the {split} split of {len(convs)} conversations "
                              f"empty; give data.{split}_path or change data.split")
        convs = convs[rng[0]:rng[1]]
    render = Renderer(source, **special)
    ids, learned = zip(*(encode(tok, *render(c)) for c in convs))
    return Packed(list(ids), list(learned), train.seq_length, tok.eod_id, train.seed)


def _file_digest(source: str) -> str | None:
    p = Path(source)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def build(run: Any, *, split: str, dp_rank: int, dp_size: int, consumed_samples: int = 0) -> Iterator[dict[str, Any]]:
    """Micro-batches of packed conversations for one data-parallel rank (see the module's text)."""
    import torch

    from zoo.config.rampup import rank_micro_batches

    packed = load_split(run, split)
    n = len(packed)
    final = run.train.global_batch_size or run.train.micro_batch_size * dp_size
    orders: dict[int, np.ndarray] = {}

    def row(g: int) -> int:
        epoch = g // n
        if epoch not in orders:
            orders.clear()
            orders[epoch] = np.random.default_rng([run.train.seed, epoch]).permutation(n)
        return int(orders[epoch][g % n])

    for picks in rank_micro_batches(run.train, split=split, consumed=consumed_samples, dp_rank=dp_rank,
                                    dp_size=dp_size, final=final):
        pick = [row(g) for g in picks]
        yield {f: torch.from_numpy(getattr(packed, f)[pick]) for f in Packed.FIELDS}

