"""Launch one fused scoring kernel on a generated pool, for Nsight Compute (`ncu`) to profile:

    ncu --clock-control none --kernel-name regex:score_ --launch-skip 2 --launch-count 1 \
        python3 scripts/probe_score_mma.py --version 5 --precision fp16 --dim 64

Builds a pool of `--ads` slots on the device (as `andromeda bench score` does), every ad eligible
(or a random `--eligible` share of them, as a request's match leaves it, for `--requests` requests),
and launches the scoring kernel `--launches` times (the first compiles); with `--topk`, the final
top-K kernels after each (profile them with `--kernel-name regex:topk`)."""

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", type=int, default=5)
    ap.add_argument("--kind", default="moe", choices=("moe", "dot"))
    ap.add_argument("--precision", default="fp16", choices=("fp32", "fp16", "int8"))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ads", type=int, default=1 << 24)
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--eligible", type=float, default=1.0, help="share of the slots eligible (random)")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--topk", action="store_true", help="launch the final top-K after each scoring launch")
    args = ap.parse_args()

    from andromeda_nb.devices import resolve
    from gpu import runtime

    resolve("gpu", kernels=True)
    cuda = runtime.cuda()
    import cupy as xp

    from andromeda_nb.model import MoeModel
    from andromeda_nb.scoring import dot_table
    from benchmarks.score import _request_tables, make_pool
    from gpu.fused import FusedScorer
    from gpu.kernels import score as sk
    from gpu.lab import score as lab

    model = MoeModel.init(0, D=args.dim)
    us, tab = _request_tables(model, 0)
    tabs = tab[None] if args.kind == "moe" else dot_table(us.U.mean(axis=0), model.E, model.F)[None]
    pool = make_pool(xp, args.ads, args.dim, args.precision, model.F, 0, keep_rows=False)
    fs = FusedScorer.on_device(cuda.as_cuda_array(pool.tiles), cuda.as_cuda_array(pool.scale), pool.chunk_format,
                               np.arange(args.ads, dtype=np.int64), precision=args.precision, dim=args.dim,
                               experts=model.E, top_e=model.top_k, version=lab.VERSIONS[args.version], kind=args.kind)
    R = args.requests
    if args.eligible >= 1.0:
        bits = np.full((R, args.ads // 32), 0xFFFFFFFF, np.uint32)
    else:
        rng = np.random.default_rng(1)
        bits = np.stack([np.packbits(rng.random(args.ads) < args.eligible, bitorder="little").view(np.uint32)
                         for _ in range(R)])
    elig = cuda.to_device(bits)
    d_tabs = cuda.to_device(np.repeat(tabs.astype(np.float32), R, axis=0))
    b = fs._buffers(R, 100)
    cap = sk.cap_for(100, fs.kernel.ads_per_block)
    for _ in range(args.launches):
        fs.kernel.launch(fs.d_emb, fs.d_scale, fs.d_chunk_format, elig, d_tabs, cap, b["cand_key"], b["cand_slot"])
        if args.topk:
            fs.final_topk(b, cap, 100, R)
    cuda.synchronize()
    print("launched", args.launches, "times:", lab.VERSIONS[args.version].name, args.kind, args.precision, args.dim,
          f"requests {R}, eligible {args.eligible:g}" + (", with the final top-K" if args.topk else ""))


if __name__ == "__main__":
    main()
