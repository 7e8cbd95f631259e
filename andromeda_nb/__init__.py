"""andromeda-nb's shared contract (docs/DESIGN.md): targeting semantics and oracle, corpus, model and reference,
comparison rules, protocol; it imports neither architecture."""

__version__ = "0.1.0"
