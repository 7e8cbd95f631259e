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
    """Two panels: recall@K against FLOPs per ad (one point per model, the truth rankers as lines),
    and recall@K by the users' number of interests. Returns None when written, else why not
    (matplotlib missing: the `plots` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'andromeda-nb[plots]')"
    cfg = result.config
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.0, 4.6), dpi=120)
    colors = {"two_tower": "tab:red", "moe_k1": "tab:cyan", "moe_k2": "tab:blue", "moe_k4": "tab:purple",
              "dense": "black"}
    ref_styles = {"context_blind_truth": ("tab:green", "--"), "single_vector_truth": ("tab:orange", ":"),
                  "random": ("tab:gray", "-.")}
    xs = [result.flops_per_ad[n] for n in MODEL_NAMES]
    ys = [result.recall[n] for n in MODEL_NAMES]
    left.plot(xs[1:], ys[1:], "-", color="tab:blue", alpha=0.5)
    for j, (n, x, y) in enumerate(zip(MODEL_NAMES, xs, ys)):
        left.plot([x], [y], "s" if n == "two_tower" else "o", color=colors[n], label=f"{LABELS[n]} ({y:.3f})")
        left.annotate(LABELS[n], (x, y), textcoords="offset points", xytext=(-20, 10 if j % 2 else -16), fontsize=8)
    for name, (color, style) in ref_styles.items():
        left.axhline(result.references[name], color=color, linestyle=style, linewidth=1,
                     label=f"{LABELS[name]} ({result.references[name]:.3f})")
    left.set_xlim(0, max(xs) * 1.1)
    left.set_ylim(0.0, 1.25)
    left.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    left.set_xlabel("FLOPs per scored ad")
    left.set_ylabel(f"recall@{cfg.recall_k}")
    left.set_title("Recall against arithmetic per ad", fontsize=10)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7, loc="upper center", ncol=3)

    counts = sorted(result.requests_by_interests)
    width = 0.8 / (len(MODEL_NAMES) + 1)
    for j, n in enumerate(MODEL_NAMES):
        right.bar([c + (j - len(MODEL_NAMES) / 2) * width for c in counts],
                  [result.recall_by_interests[n][c] for c in counts], width, color=colors[n], label=LABELS[n])
    single = result.references_by_interests["single_vector_truth"]
    right.plot(counts, [single[c] for c in counts], "o:", color="tab:orange", label=LABELS["single_vector_truth"])
    blind = result.references_by_interests["context_blind_truth"]
    right.plot(counts, [blind[c] for c in counts], "o--", color="tab:green", label=LABELS["context_blind_truth"])
    right.set_xticks(counts)
    right.set_xticklabels([f"{c} (n={result.requests_by_interests[c]})" for c in counts])
    right.set_xlabel("interests of the user (requests)")
    right.set_ylim(0.0, 1.25)
    right.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    right.set_title(f"Recall@{cfg.recall_k} by the user's number of interests", fontsize=10)
    right.grid(True, axis="y", alpha=0.3)
    right.legend(fontsize=7, loc="upper center", ncol=4)
    fig.suptitle(f"andromeda quality, seed {cfg.seed}: {cfg.truth.ads} ads, {cfg.eligible_fraction:.0%} eligible, "
                 f"{cfg.test_requests} test requests, E = {cfg.truth.experts}, D = {cfg.truth.dim}, "
                 f"{cfg.precision} embeddings", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def write_outputs(result: QualityResult, out_dir, *, make_plot: bool = True,
                  extra: dict | None = None) -> dict[str, str]:
    """Write the model files, quality.json and (when matplotlib is there) quality.png into out_dir.
    `extra` (e.g. "kind" and "provenance" from andromeda_nb.provenance) is added to quality.json.
    Returns {what: path or the reason it was skipped}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, filename in MODEL_FILES.items():
        result.models[name].save(out / filename)
        written[name] = str(out / filename)
    with open(out / "quality.json", "w") as fh:
        json.dump({**result.summary(), **(extra or {})}, fh, indent=2)
        fh.write("\n")
    written["summary"] = str(out / "quality.json")
    if make_plot:
        why = plot(result, out / "quality.png")
        written["plot"] = str(out / "quality.png") if why is None else f"skipped: {why}"
    return written


__all__ = ["LABELS", "MODEL_FILES", "format_table", "plot", "summary_line", "write_outputs"]
