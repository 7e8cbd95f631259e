"""The benchmarks, beside the product and never imported by it (tests/test_layers.py keeps it so):
each measures what a shipped module does, checks it against the reference first, and writes its
figures through `andromeda_nb.measure`.

    cpu               `andromeda bench cpu`: the CPU index and the remote-scoring path
    match             `bench match`: every match kernel version of the lab on tiled pools
    match_both        `bench match` with the CPU index beside the GPU one
    score, peers      `bench score`: every scoring kernel version, and the PyTorch and CuPy peers
    tiled, tiling     pools tiled from a small generated corpus, laid out on the device
    tiled_shard       a shard process over a tiled pool (`bench cluster --tiled`)
    served            `bench served`: many plain Flight clients against `serve colocated`, against the
                      engine in process
    cluster           `bench cluster`: shards behind a router
    clients           many plain Flight clients against one server: the served path's load
    demo              `andromeda demo`: the migration walked step by step, measured
    report            `bench report`: docs/BENCHMARKS.md rendered from result files
"""
