"""Errors that the `zoo` command line turns into one clear line and an exit code.

Exit codes: 2 for a usage or configuration mistake the user can fix by changing what they typed,
1 for a failure while running. Anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
from collections.abc import Iterable, Iterator


class ZooError(Exception):
    """A failure the user should read as one line (exit code 1)."""

    exit_code = 1


class UsageError(ZooError):
    """Wrong command, option, name or configuration value (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration key or value is wrong; the message names the key and where it came from."""


class PluginError(ZooError):
    """A plugin is broken, conflicts with another, or breaks the contract; names the plugin."""


class UnknownNameError(UsageError):
    """A name (family, flavor, key, command) that does not exist; the message suggests close ones."""


def suggest(name: str, candidates: Iterable[str], *, n: int = 3) -> str:
    """Return ' (did you mean a, b?)' for the closest candidates, or '' when nothing is close."""
    pool = sorted(set(candidates))
    close = difflib.get_close_matches(name, pool, n=n, cutoff=0.6)
    if not close:
        # Prefix matches catch abbreviations ('lla' -> 'llama') that the ratio misses.
        close = [c for c in pool if c.startswith(name) or name.startswith(c)][:n] if name else []
    return f" (did you mean {', '.join(close)}?)" if close else ""


@contextlib.contextmanager
def reading(path: object, error: type[ZooError] = ZooError, what: str = "") -> Iterator[None]:
    """Interpret a document read from ``path``: a missing key or a value of the wrong type or range
    becomes one error naming the file. A corrupt or hand-edited file is the user's to fix, so it
    must not surface as a bare ``KeyError`` from deep inside zoo."""
    try:
        yield
    except ZooError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:300]
        raise error(f"{path}: malformed{' ' + what if what else ''} ({type(e).__name__}: {detail})") from None


def at_least_one(text: str) -> int:
    """An argparse type for a count or size: an int of at least 1, refused in argparse's one line
    (``argument --size: 0: must be at least 1``), where 0 or less would mean an empty output, a
    default taken silently for a falsy 0, or an error deep inside the command."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value
