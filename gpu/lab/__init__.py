"""The kernel lab: every version of each GPU kernel family (match, scoring, top-K), the superseded ones
beside the shipped ones, with one `VERSIONS` table per family. The benchmarks time these tables and
the tests check them; the product (`gpu/kernels/`, `gpu/index.py`, `gpu/fused.py`) never imports the lab.
"""
