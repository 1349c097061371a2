"""`zoo data info / lint / preview` of a conversations file (the ``sft`` dataset, `zoo.data.sft`)."""

from __future__ import annotations

import numpy as np

from zoo.data.sft import ZOO_TEMPLATE, Renderer, conversations, encode, pack, read, template_source
from zoo.errors import UsageError


def describe(path: str, *, tokenizer: str | None, chat_template: str | None, seq_length: int | None,
             lint: bool) -> int:
    """`zoo data info` / `zoo data lint` of a conversations file: counts, and with a tokenizer the
    tokens, the learned tokens and the rows they pack into; lint reports every problem (exit 1)."""
    convs, problems = read(path)
    roles: dict[str, int] = {}
    for c in convs:
        for m in c:
            roles[m["role"]] = roles.get(m["role"], 0) + 1
    print(f"{path}: {len(convs):,} conversation{'' if len(convs) == 1 else 's'} (sft), messages: "
          + ", ".join(f"{n:,} {r}" for r, n in sorted(roles.items())))
    if tokenizer is not None and convs:
        from zoo.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        source, special = template_source(tokenizer, chat_template)
        if special.get("eos_token") is None and tok.backend is not None:
            special["eos_token"] = tok.backend.id_to_token(tok.eod_id)
        render = Renderer(source, **special)
        lengths, learned = [], 0
        for i, c in enumerate(convs):
            try:
                ids, mask = encode(tok, *render(c))
            except UsageError as e:
                problems.append(f"{path}: conversation {i + 1}: {e}")
                continue
            lengths.append(len(ids))
            learned += int(mask.sum())
        if lengths:
            arr = np.asarray(lengths)
            print(f"tokens: {int(arr.sum()):,} ({learned:,} learned), per conversation min {arr.min()} mean "
                  f"{arr.mean():.1f} max {arr.max()}; template: "
                  f"{'zoo' if source == ZOO_TEMPLATE else chat_template or 'the tokenizer' + chr(39) + 's'}")
            if seq_length:
                rows = pack([min(n - 1, seq_length) for n in lengths], seq_length)
                cut = int((arr - 1 > seq_length).sum())
                print(f"seq_length {seq_length}: {len(rows):,} packed rows, {(arr - 1).clip(max=seq_length).sum() / (len(rows) * seq_length):.1%} "
                      f"filled" + (f", {cut:,} cut to it (longer)" if cut else ""))
    if lint or problems:
        for line in problems[:50]:
            print(line)
        print(f"{len(convs) + len(problems):,} lines checked, {len(problems)} problem(s)"
              + (" (first 50 shown)" if len(problems) > 50 else ""))
    return 1 if problems else 0


def preview(path: str, *, tokenizer: str | None, chat_template: str | None, n: int) -> int:
    """`zoo data preview FILE.jsonl`: the first ``n`` conversations as the template renders them,
    the learned tokens between ⟦ and ⟧ (with ``tokenizer``: decoded token runs, as training sees
    them; without: the characters of the answers' spans under zoo's plain template)."""
    from zoo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    source, special = template_source(tokenizer, chat_template)
    if special.get("eos_token") is None:
        special["eos_token"] = tok.backend.id_to_token(tok.eod_id) if tok is not None and tok.backend is not None \
            else "<|endoftext|>"
    render = Renderer(source, **special)
    for i, conv in enumerate(conversations(path)[:n]):
        text, spans = render(conv)
        if tok is None:
            shown, at = [], 0
            for a, b in spans:
                shown += [text[at:a], "⟦", text[a:b], "⟧"]
                at = b
            out = "".join(shown + [text[at:]])
        else:
            ids, learned = encode(tok, text, spans)
            pieces, start = [], 0
            for j in range(1, len(ids) + 1):  # runs of learned / not learned tokens, decoded
                if j == len(ids) or learned[j] != learned[start]:
                    piece = tok.decode(ids[start:j].tolist())
                    pieces.append(f"⟦{piece}⟧" if learned[start] else piece)
                    start = j
            out = "".join(pieces)
            out += f"\n({len(ids)} tokens, {int(learned.sum())} learned)"
        print(f"--- conversation {i + 1}\n{out}")
    return 0
