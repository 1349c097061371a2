"""The version of zoo-core (one place; `zoo.__version__` re-exports it)."""

__version__ = "0.1.0"
