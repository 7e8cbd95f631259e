"""Retrieval quality on data whose truth is known (`andromeda quality`).

* `truth`: the synthetic world: multi-interest users seen through E signal groups, ads with topics
  and stored embeddings, the richer ranking model that defines relevance, logged impressions and
  clicks sampled from it.
* `train`: numpy trainers with hand-written gradients (checked against finite differences in the
  tests) for the DESIGN section 3 mixture of user experts and the two-tower baseline; Adam, seeded.
* `experiment`: the whole run: train two_tower, moe_k1, moe_k2, moe_k4 and dense, measure recall@K
  through the serving reference, FLOPs and bytes per ad.
* `report`: the table, the JSON summary, the model files and the plot.
The fused kernel's ads per second on the trained models (where a CUDA GPU is usable) is measured a
layer up, by `migration.quality_kernel`.
"""

from .experiment import MODEL_NAMES, QualityConfig, QualityResult, run_quality
from .truth import TruthConfig, World

__all__ = ["MODEL_NAMES", "QualityConfig", "QualityResult", "TruthConfig", "World", "run_quality"]
