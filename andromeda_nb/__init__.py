"""andromeda-nb shared core: targeting semantics and oracle, corpus, model and reference, harness."""

__version__ = "0.1.0"
