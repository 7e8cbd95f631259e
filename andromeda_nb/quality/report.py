"""Output of the quality experiment: the stdout table, the JSON summary, the model files and the plot.

Files `write_outputs` puts in the output directory:
    model.npz          the served MoE variant (k = 2) with the two-tower weights T, t: both
                       architectures serve it unchanged
    model_k1.npz, model_k4.npz, model_dense.npz   the other variants (each with T, t too)
    quality.json       the summary (`QualityResult.summary()`)
    quality.png        recall@K against FLOPs per ad (needs the optional `plots` extra, matplotlib)
"""

from __future__ import annotations

import json
from pathlib import Path

from .experiment import MODEL_NAMES, REFERENCE_NAMES, SERVED, QualityResult

MODEL_FILES = {SERVED: "model.npz", "moe_k1": "model_k1.npz", "moe_k4": "model_k4.npz", "dense": "model_dense.npz"}
LABELS = {
    "two_tower": "two-tower",
    "moe_k1": "MoE k=1",
    "moe_k2": "MoE k=2",
    "moe_k4": "MoE k=4",
    "dense": "MoE dense",
    "context_blind_truth": "truth without context terms",
    "single_vector_truth": "truth as one vector",
    "random": "random",
}


def format_table(result: QualityResult) -> str:
    """The stdout table: recall@K overall and by the users' interest count, cost per ad, and the
    reference rankers."""
    cfg = result.config
    E = cfg.truth.experts
    counts = sorted(result.requests_by_interests)
    precision = cfg.precision
    head = (f"recall@{cfg.recall_k} against the ranking model's top {cfg.recall_k} among eligible ads "
            f"(seed {cfg.seed}; {cfg.truth.ads} ads, {cfg.eligible_fraction:.0%} eligible; "
            f"{cfg.test_requests} test requests; E = {E}, D = {cfg.truth.dim}; {precision} embeddings)")
    by_cols = [f"{c} int. (n={result.requests_by_interests[c]})" for c in counts]
    cols = ["model", "recall", *by_cols, "FLOPs/ad", f"bytes/ad {precision}", "bytes/ad int8", "test log-loss"]
    rows = []
    for name in MODEL_NAMES:
        rows.append([
            LABELS[name],
            f"{result.recall[name]:.3f}",
            *(f"{result.recall_by_interests[name][c]:.3f}" for c in counts),
            str(result.flops_per_ad[name]),
            str(result.bytes_per_ad[precision]),
            str(result.bytes_per_ad["int8"]),
            f"{result.test_loss[name]:.4f}",
        ])
    for name in REFERENCE_NAMES:
        rows.append([LABELS[name], f"{result.references[name]:.3f}", *("" for _ in counts), "", "", "", ""])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [head, ""]
    lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for r_i, r in enumerate(rows):
        if r_i == len(MODEL_NAMES):
            lines.append("  ".join("-" * w for w in widths))
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    kernel = result.kernel
    if kernel.get("ads_per_second"):
        lines.append("")
        lines.append(f"kernel ads/s ({kernel.get('device', '')}): " + ", ".join(
            f"{LABELS.get(n, n)} {v / 1e9:.2f} G" for n, v in kernel["ads_per_second"].items()))
    elif kernel.get("skipped"):
        lines.append("")
        lines.append(f"kernel ads/s: skipped ({kernel['skipped']})")
    return "\n".join(lines)


def summary_line(result: QualityResult) -> str:
    """One JSON object (the --json output): recall and flops_per_ad keyed by model, and the rest of
    the summary beside them."""
    return json.dumps(result.summary(), sort_keys=False)


def plot(result: QualityResult, path) -> str | None:
    """Recall@K against FLOPs per ad, one point per model, reference lines for the truth rankers.
    Returns None when written, else why not (matplotlib missing: the `plots` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'andromeda-nb[plots]')"
    cfg = result.config
    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    xs = [result.flops_per_ad[n] for n in MODEL_NAMES]
    ys = [result.recall[n] for n in MODEL_NAMES]
    ax.plot(xs[1:], ys[1:], "o-", color="tab:blue", label="mixture of user experts (k of 6)")
    ax.plot(xs[:1], ys[:1], "s", color="tab:red", label="two-tower")
    for n, x, y in zip(MODEL_NAMES, xs, ys):
        ax.annotate(LABELS[n], (x, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
    styles = {"context_blind_truth": ("tab:green", "--"), "single_vector_truth": ("tab:orange", ":"),
              "random": ("tab:gray", "-.")}
    for name, (color, style) in styles.items():
        ax.axhline(result.references[name], color=color, linestyle=style, linewidth=1,
                   label=f"{LABELS[name]} ({result.references[name]:.2f})")
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per scored ad (log scale)")
    ax.set_ylabel(f"recall@{cfg.recall_k}")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(f"Retrieval quality vs arithmetic per ad (seed {cfg.seed}, {cfg.truth.ads} ads)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def write_outputs(result: QualityResult, out_dir, *, make_plot: bool = True) -> dict[str, str]:
    """Write the model files, quality.json and (when matplotlib is there) quality.png into out_dir.
    Returns {what: path or the reason it was skipped}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, filename in MODEL_FILES.items():
        result.models[name].save(out / filename)
        written[name] = str(out / filename)
    with open(out / "quality.json", "w") as fh:
        json.dump(result.summary(), fh, indent=2)
        fh.write("\n")
    written["summary"] = str(out / "quality.json")
    if make_plot:
        why = plot(result, out / "quality.png")
        written["plot"] = str(out / "quality.png") if why is None else f"skipped: {why}"
    return written


__all__ = ["LABELS", "MODEL_FILES", "format_table", "plot", "summary_line", "write_outputs"]
