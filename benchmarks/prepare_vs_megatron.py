"""`zoo prepare text` against Megatron-LM's preprocessing design, same tokenizer, same workers.

Megatron's design (tools/preprocess_data.py): a multiprocessing pool parses and tokenizes JSON
lines (``imap`` with chunks of 25 lines), every token list is sent back to the main process, and
that one process writes it through megatron-core's ``IndexedDatasetBuilder``. zoo: workers tokenize
byte-range chunks in batches and write their own partial files, merged by the kernel.

Both run in fresh processes on the same JSONL at two sizes (distinct documents: the standard
library's sources, never repeated), to show throughput and that zoo's peak memory does not grow
with the input. The tokenizer (a byte-level BPE trained on the pydoc topics) is the same file for
both; Megatron's workers call the `tokenizers` library directly (faster than Megatron-LM's own
wrapper, which goes through transformers), zoo's go through its exact piece cache
(`zoo.bpe_cache`), whose regex classes are read once and cached on disk before timing.

    python benchmarks/prepare_vs_megatron.py [--mb 10 30] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TOK = None


def _init(tok_path: str) -> None:
    global _TOK
    from zoo.data.tokenizer import load_tokenizer

    _TOK = load_tokenizer(tok_path)


def _encode(line: str) -> tuple[list[int], int]:
    text = json.loads(line)["text"]
    ids = _TOK.encode(text) + [_TOK.eod_id]  # type: ignore[union-attr]
    return ids, len(line)


def megatron_design(src: Path, prefix: Path, tok: Path, workers: int) -> int:
    import warnings

    import numpy as np
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    tokens = 0
    with open(src, encoding="utf-8") as f, mp.get_context("fork").Pool(workers, _init, (str(tok),)) as pool:
        for ids, _ in pool.imap(_encode, f, 25):
            builder.add_document(torch.tensor(ids), [len(ids)])
            tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return tokens


def zoo_prepare(src: Path, prefix: Path, tok: Path, workers: int) -> int:
    from zoo.data.prepare import prepare_text

    return prepare_text(inputs=[str(src)], output_prefix=str(prefix), tokenizer=str(tok), json_keys=["text"],
                        append_eod=True, workers=workers, on_error="fail", progress=False)["tokens"]


def child(args: argparse.Namespace) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    t = time.perf_counter()
    fn = megatron_design if args.impl == "megatron" else zoo_prepare
    tokens = fn(Path(args.src), Path(args.prefix), Path(args.tok), args.workers)
    dt = time.perf_counter() - t
    # Peak RSS of this process and of its (finished) worker processes.
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    print(json.dumps({"tokens": tokens, "seconds": dt, "main_rss_mb": rss[0] / 1024, "worker_rss_mb": rss[1] / 1024}))


def stdlib_sources() -> list[Path]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.rglob("*.py"))
    # The standard library first (about 30 MB), then installed packages' sources for larger inputs.
    return [f for f in files if "site-packages" not in f.parts] + [f for f in files if "site-packages" in f.parts]


def make_corpus(path: Path, mb: int) -> int:
    """Distinct documents, none repeated (repetition would flatter any cache): the standard
    library's Python sources, one JSON line per file, up to ``mb`` MB of JSONL."""
    written, n = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        for src in stdlib_sources():
            if written >= mb * 2**20:
                break
            line = json.dumps({"text": src.read_text(encoding="utf-8", errors="replace")}) + "\n"
            f.write(line)
            written += len(line)
            n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, nargs="+", default=[10, 30])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl")
    p.add_argument("--src")
    p.add_argument("--prefix")
    p.add_argument("--tok")
    args = p.parse_args()
    if args.child:
        return child(args)
    from zoo.data.tokenizer import train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        from pydoc_data.topics import topics

        train_bpe([topics[k] for k in sorted(topics)], 8192).save(tmp_path)
        tok = tmp_path / "tokenizer.json"
        from zoo.data.bpe_cache import engine_classes

        engine_classes()  # a one-time cost per tokenizers version, not per run
        print(f"# {time.strftime('%Y-%m-%d')} {os.cpu_count()} CPUs, {args.workers} workers, byte-level BPE 8192")
        print(f"{'input MB':>8} {'impl':<8} {'tokens/s':>10} {'seconds':>8} {'main RSS MB':>11} {'worker RSS MB':>13}")
        for mb in args.mb:
            src = tmp_path / f"c{mb}.jsonl"
            make_corpus(src, mb)
            res = {}
            for impl in ("megatron", "zoo"):
                out = subprocess.run([sys.executable, __file__, "--child", f"--impl={impl}", f"--src={src}",
                                      f"--prefix={tmp_path / f'{impl}{mb}'}", f"--tok={tok}", f"--workers={args.workers}"],
                                     capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                res[impl] = r
                print(f"{mb:>8} {impl:<8} {r['tokens'] / r['seconds']:>10,.0f} {r['seconds']:>8.1f} "
                      f"{r['main_rss_mb']:>11.0f} {r['worker_rss_mb']:>13.0f}")
            same = all((tmp_path / f"zoo{mb}_text_document{e}").read_bytes() == (tmp_path / f"megatron{mb}{e}").read_bytes()
                       for e in (".bin", ".idx"))
            ratio = res["megatron"]["seconds"] / res["zoo"]["seconds"]
            print(f"{mb} MB: zoo/Megatron tokens/s {ratio:.2f}x (target >= 3x); outputs byte-identical: {same}")


if __name__ == "__main__":
    main()
