"""Counts of the conversion parity draws per architecture (drawn / equal / refused, and why
refused), for docs/conversion.md:

    python tests/conversion/parity_counts.py --first 0 --draws 3     # the default suite's draws
    python tests/conversion/parity_counts.py --first 3 --draws 50    # the slow suite's

A silent difference is counted, and the draw that reproduces it printed to stderr; the exit status
is then 1."""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _parity_draws import ARCHITECTURES, draw  # noqa: E402
from _parity_harness import SilentDifference, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--arch", nargs="+", choices=ARCHITECTURES, help="only these architectures")
    args = ap.parse_args()
    print("| architecture | drawn | equal | refused | silent | refusals (first words) |\n|---|---|---|---|---|---|")
    silent_total = 0
    for arch in args.arch or ARCHITECTURES:
        counts: collections.Counter[str] = collections.Counter()
        why: collections.Counter[str] = collections.Counter()
        for seed in range(args.first, args.first + args.draws):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    outcome = run(draw(arch, seed), seed, Path(tmp))
                except SilentDifference as e:
                    counts["silent"] += 1
                    print(f"{arch} seed {seed}: {e}", file=sys.stderr, flush=True)
                    continue
            counts[outcome.status] += 1
            if outcome.status == "refused":
                text = outcome.detail.split(": ", 1)[-1]
                why[" ".join(text.split()[:6])] += 1
        reasons = "; ".join(f"{n}x {w}" for w, n in why.most_common(4))
        silent_total += counts["silent"]
        print(f"| {arch} | {sum(counts.values())} | {counts['equal']} | {counts['refused']} | {counts['silent']} "
              f"| {reasons} |", flush=True)
    sys.exit(1 if silent_total else 0)


if __name__ == "__main__":
    main()
