"""Named constants of the contract (DESIGN sections 2-4): enumerations, limits and default sizes.

Every implementation imports these; no other module spells a limit or an enumeration as a literal.
Enumerations are tuples in the order DESIGN lists them: that order is also the one-hot order of the
model's context vector and the bit order of the placement masks.
"""

from __future__ import annotations

# --- targeting enumerations (DESIGN section 2) -------------------------------------------------------
GENDERS = (1, 2)  # 1 male, 2 female; a user may also have 0 (unknown)
USER_GENDERS = (0, 1, 2)
PUBLISHER_PLATFORMS = ("facebook", "instagram", "audience_network", "messenger")
DEVICE_PLATFORMS = ("mobile", "desktop", "connected_tv")
USER_OS = ("iOS", "Android", "Windows", "macOS", "Linux", "other")
STATUSES = ("ACTIVE", "PAUSED", "ARCHIVED", "DELETED")
STATUS_CODE = {name: code for code, name in enumerate(STATUSES)}
ACTIVE = STATUS_CODE["ACTIVE"]

# id-list keys of a flexible_spec / exclusions object, in DESIGN's order
FLEX_KEYS = (
    "interests",
    "behaviors",
    "life_events",
    "industries",
    "income",
    "family_statuses",
    "education_statuses",
    "relationship_statuses",
    "work_positions",
)
# id lists a user profile carries: the flexible keys plus custom audiences
USER_ID_KEYS = FLEX_KEYS + ("custom_audiences",)
GEO_KEYS = ("countries", "regions", "cities", "custom_locations")

# --- limits --------------------------------------------------------------------------------------------
AGE_LOWEST = 13
AGE_HIGHEST = 65  # age_max == 65 means "65 and older"
AGE_MIN_DEFAULT = 18
AGE_MAX_DEFAULT = 65
MAX_FLEXIBLE_SPEC_OBJECTS = 25
MAX_IDS_PER_OBJECT = 1000
MAX_RADIUS_KM = 80.0
MAX_RADIUS_MILES = 50.0
KM_PER_MILE = 1.609344
EARTH_RADIUS_KM = 6371.0088
DISTANCE_UNITS = ("kilometer", "mile")
BOUNDARY_SLACK_KM = 1e-6  # implementations may disagree with the oracle this close to a radius

# --- model sizes (DESIGN section 3) --------------------------------------------------------------------
DEFAULT_D = 64  # embedding dim
DEFAULT_E = 6  # experts
DEFAULT_TOP_EXPERTS = 2  # k active experts
DEFAULT_F = 8  # ad formats
SIGNAL_WIDTH = 16  # S
HOUR_BUCKETS = 4  # (time // 3600) % 24 // 6
CONTEXT_WIDTH = len(PUBLISHER_PLATFORMS) + len(DEVICE_PLATFORMS) + len(USER_OS) + HOUR_BUCKETS  # 17
PRECISIONS = ("fp32", "fp16", "int8")
LAYOUTS = ("format", "geo")  # slot orders within a format: the corpus's, or clustered by geography (geo_layout)
# the GPU engine's slot order unless told: by geography, which measured faster at 10M and 100M, one request
# and batches of 64 (docs/BENCHMARKS.md, "The layout by geography on a GPU")
DEFAULT_LAYOUT = "geo"
# how the GPU engine enqueues a batch's plan (gpu.pipeline): replayed from a CUDA graph, or step by step
LAUNCHES = ("graph", "direct")
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}  # bytes of one stored embedding value
INT8_SCALE_BYTES = 4  # an int8 embedding carries one float32 scale

# --- answers and comparison (DESIGN section 4) ---------------------------------------------------------
DEFAULT_K = 100
MAX_K = 4096
SCORE_ATOL = 1e-4  # float32 arithmetic vs the float64 reference
GATE_TIE_ATOL = 1e-4  # k-th and (k+1)-th gate logits this close: either routing is accepted
TOPK_TIE_ATOL = 1e-4
REDUCED_SCORE_RTOL = 1e-2  # reduced-precision modes: relative to the reference's score spread
REDUCED_MIN_RECALL = 0.99

# --- seeded data (the corpus generator, the test data, the quality world) ---------------------------------
DATA_EPOCH = 1_767_225_600  # 2026-01-01T00:00:00Z: generated schedules and request times lie around it
SECONDS_PER_DAY = 86_400

# --- storage ------------------------------------------------------------------------------------------
SCHEMA_VERSION = 1
