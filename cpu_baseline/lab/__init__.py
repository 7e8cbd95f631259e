"""The CPU scorer lab: every version of the CPU scorer, the superseded ones beside the shipped one, with
the `VERSIONS` table shape every kernel family shares (`andromeda_nb.versions`). `andromeda bench cpu`
times it and the tests check it; the shipped scorer (`cpu_baseline/scorer.py`) never imports the lab.
"""
