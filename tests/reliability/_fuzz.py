"""A seeded file fuzzer for the formats zoo reads, and the judge of what the CLI did with each case.

A *target* is one file of a valid artefact (a Megatron dataset, an Energon dataset, a Hugging Face
model folder, a zoo checkpoint, a config) and the `zoo` command that reads it. Each case copies the
artefact, replaces that file by a mutation of it and runs the command in this process. The case
passes when the command either succeeds or fails the way a user can act on: exit code 1 or 2, one
line ``zoo: error: ...`` that names the file (its name or a path inside it), no traceback, within
the watchdog's time, and without the process's peak memory growing by more than the artefact's
size plus a fixed allowance (a header that declares a terabyte must not be allocated).

Mutations, all drawn from ``random.Random(seed)``: truncation (to nothing, inside the header, near
the end), bit flips, a random span overwritten, bytes appended, a declared length made huge or
negative (the first 8-byte words of a binary header, the numbers of a text file), and for text
files structural edits (a line deleted, a value replaced by another type).
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import signal
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

# Peak memory a case may add on top of the artefact's size: building a tiny model and importing
# what a command imports the first time (the first case of each target is run twice for that reason).
MEMORY_ALLOWANCE = 160 * 2**20
WATCHDOG_S = 30


@dataclass
class Target:
    name: str                            # e.g. "safetensors shard (HF)"
    root: Path                           # the valid artefact (a folder), never modified
    file: str                            # the file fuzzed, relative to the root
    argv: Callable[[Path, Path], list[str]]  # (copy of the root, scratch dir) -> zoo arguments
    text: bool = False                   # JSON/YAML: also structural and numeric mutations
    names: Sequence[str] = ()            # other names the error may give instead of the file's own


@dataclass
class Outcome:
    target: str
    case: str
    rc: int
    line: str
    seconds: float
    grew_mb: float
    problems: list[str] = field(default_factory=list)


def _binary_mutations(data: bytes, rng: Random) -> list[tuple[str, bytes]]:
    n = len(data)
    out: list[tuple[str, bytes]] = [("empty", b"")]
    for _ in range(2):
        k = rng.randrange(0, max(n, 1))
        out.append((f"truncated to {k}", data[:k]))
    k = rng.randrange(1, min(64, n) + 1) if n else 0
    out.append((f"truncated inside the header to {k}", data[:k]))
    out.append(("last byte cut", data[:-1]))
    for _ in range(4):
        b = bytearray(data)
        flips = rng.randint(1, 8)
        for _ in range(flips):
            if b:
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        out.append((f"{flips} bits flipped", bytes(b)))
    b = bytearray(data)
    if b:
        i = rng.randrange(len(b))
        span = rng.randint(1, 64)
        b[i:i + span] = bytes(rng.randrange(256) for _ in range(min(span, len(b) - i)))
    out.append(("random span", bytes(b)))
    out.append(("junk appended", data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))))
    # Declared lengths: an 8-byte word of the header (safetensors' header size, the .idx counts,
    # a .tar.idx offset) made huge or negative.
    for value in (2**40, 2**63 - 1, -1 & (2**64 - 1)):
        b = bytearray(data)
        words = max(min(len(b), 64) // 8, 1)
        i = 8 * rng.randrange(words)
        b[i:i + 8] = struct.pack("<Q", value)
        out.append((f"word at {i} = {value}", bytes(b)))
    if n > 16:  # one 4-byte count too (the .idx dtype code and sequence count are narrower)
        b = bytearray(data)
        i = rng.randrange(0, min(n, 48) - 4)
        b[i:i + 4] = struct.pack("<I", 0xFFFFFFFF)
        out.append((f"u32 at {i} = 2**32-1", bytes(b)))
    return out


_NUMBER = re.compile(rb"(?<![\w.])-?\d+(\.\d+)?(?![\w.])")


def _text_mutations(data: bytes, rng: Random) -> list[tuple[str, bytes]]:
    out = _binary_mutations(data, rng)[:8]
    numbers = list(_NUMBER.finditer(data))
    for value in (b"10000000000000", b"-1", b"0", b"1e308", b"\"x\"", b"[]", b"null"):
        if numbers:
            m = rng.choice(numbers)
            out.append((f"number {m.group().decode()} -> {value.decode()}", data[:m.start()] + value + data[m.end():]))
    lines = data.splitlines(keepends=True)
    for _ in range(3):
        if lines:
            i = rng.randrange(len(lines))
            out.append((f"line {i + 1} deleted", b"".join(lines[:i] + lines[i + 1:])))
    strings = list(re.finditer(rb'"[^"\n]*"|(?<=: )[A-Za-z_][\w.]*', data))
    for value in (b"123", b"[1, 2]", b"{}", b"null", b'"' + b"A" * 5000 + b'"'):
        if strings:
            m = rng.choice(strings)
            out.append((f"value {m.group()[:30].decode(errors='replace')} -> {value[:12].decode()}",
                        data[:m.start()] + value + data[m.end():]))
    out.append(("not UTF-8", b"\xff\xfe" + data))
    return out


def mutations(data: bytes, seed: int, *, text: bool) -> list[tuple[str, bytes]]:
    rng = Random(seed)
    return (_text_mutations if text else _binary_mutations)(data, rng)


def _peak_reset() -> int:
    """Reset the process's peak resident size (Linux `clear_refs`) and return the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


_LINT_SUMMARY = re.compile(r"^[\d,]+ samples checked, \d+ problem", re.M)


class _Watchdog(Exception):
    pass


def run_case(target: Target, case: str, content: bytes, scratch: Path) -> Outcome:
    from zoo.cli import main

    shutil.rmtree(scratch, ignore_errors=True)
    copy = scratch / "in"
    shutil.copytree(target.root, copy, symlinks=True)
    (copy / target.file).write_bytes(content)
    size = sum(p.stat().st_size for p in copy.rglob("*") if p.is_file())
    argv = target.argv(copy, scratch)
    out, err = io.StringIO(), io.StringIO()
    fired = []

    def alarm(*_: object) -> None:
        fired.append(True)
        raise _Watchdog()

    old = signal.signal(signal.SIGALRM, alarm)
    before = _peak_reset()
    t0 = time.monotonic()
    signal.alarm(WATCHDOG_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except _Watchdog:
        rc = -1
    except BaseException as e:  # noqa: BLE001 - a fuzz case reports whatever escaped
        rc = -2
        err.write(f"escaped the CLI: {type(e).__name__}: {e}\n")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    seconds = time.monotonic() - t0
    grew = _status("VmHWM") - before
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("zoo: error:")]
    o = Outcome(target.name, case, rc, errors[0] if errors else (lines[-1] if lines else ""), seconds, grew / 2**20)
    if fired or rc == -1:
        o.problems.append(f"still running after {WATCHDOG_S} s")
    elif rc == -2:
        o.problems.append(lines[-1] if lines else "escaped the CLI")
    elif rc == 1 and not errors and _LINT_SUMMARY.search(out.getvalue()):
        # `zoo data lint` reports every problem it found, one line each, then a count.
        report = out.getvalue().splitlines()
        problems = report[:next(i for i, x in enumerate(report) if _LINT_SUMMARY.match(x))]
        names = {Path(target.file).name, *target.names}
        o.line = problems[0] if problems else report[-1]
        if not problems or not all(any(n in x for n in names) for x in problems):
            o.problems.append(f"a lint problem line does not name {Path(target.file).name}: {problems[:3]}")
    elif rc != 0:
        if rc not in (1, 2):
            o.problems.append(f"exit code {rc}")
        if len(errors) != 1:
            o.problems.append(f"{len(errors)} 'zoo: error:' lines in stderr: {err.getvalue()[-400:]!r}")
        elif "Traceback" in err.getvalue() or "run with --debug for the traceback" in errors[0]:
            o.problems.append("an unexpected exception, not a handled error")
        names = {Path(target.file).name, *target.names}
        if errors and not any(n in errors[0] for n in names):
            o.problems.append(f"the error does not name {Path(target.file).name}")
    if grew > size + MEMORY_ALLOWANCE:
        o.problems.append(f"peak memory grew by {grew / 2**20:.0f} MB for {size / 2**20:.1f} MB of files")
    return o


def fuzz(targets: Sequence[Target], per_target: int, scratch: Path, *, seed: int = 0) -> list[Outcome]:
    """``per_target`` cases for each target (mutations drawn from successive seeds)."""
    outcomes: list[Outcome] = []
    for ti, t in enumerate(targets):
        data = (t.root / t.file).read_bytes()
        # Unmodified first: the command must succeed on the valid artefact (else the target is
        # wrong, not the reader), and it pays the imports before memory is measured.
        first = run_case(t, "unmodified", data, scratch)
        if first.rc != 0:
            raise AssertionError(f"{t.name}: the unmodified artefact fails: {first.line}")
        cases: list[tuple[str, bytes]] = []
        s = 0
        while len(cases) < per_target:
            cases.extend(mutations(data, seed * 1_000_003 + ti * 1009 + s, text=t.text))
            s += 1
        for case, content in cases[:per_target]:
            outcomes.append(run_case(t, case, content, scratch))
    shutil.rmtree(scratch, ignore_errors=True)
    return outcomes


def summary(outcomes: Sequence[Outcome]) -> str:
    by: dict[str, list[int]] = {}
    for o in outcomes:
        row = by.setdefault(o.target, [0, 0, 0, 0])
        row[0] += 1
        row[1 if o.rc == 0 else 2] += 1
        row[3] += bool(o.problems)
    lines = [f"{'target':<44} {'cases':>5} {'loaded':>6} {'refused':>7} {'bad':>4}"]
    lines += [f"{k:<44} {v[0]:>5} {v[1]:>6} {v[2]:>7} {v[3]:>4}" for k, v in by.items()]
    return "\n".join(lines)
