"""The retrieval model of DESIGN section 3: weights, the per-request user side, and stored embeddings.

* `MoeModel`: the float32 weights `W` (E, D, S), `b` (E, D), `K` (E, D, D), `A` (F, D, C), `B` (F, D, C),
  the number of routed experts `top_k`, and optionally the two-tower weights `T` (D, E*S), `t` (D,).
  `MoeModel.init(seed)` makes seeded weights; `save`/`load` read and write `model.npz`.
* `context_vector(context)`: the 17 one-hot context features `c`, float64.
* `user_side(model, request)`: what is computed once per request, in float64:
      U[e]     = tanh(W[e] @ x_e + b[e])        (E, D)   expert e reads signal group e
      Q[e]     = K[e] @ U[e]                    (E, D)   gate keys
      gamma[f] = 1 + tanh(A[f] @ c)             (F, D)   per-format FiLM scale
      beta[f]  = B[f] @ c                       (F, D)   per-format FiLM shift
  Kernels take these tables cast to float32.
* `user_sides(model, requests)`: the same for a batch, as arrays with a leading request axis
  (U, Q, gamma, beta); one vectorized pass instead of a Python call per request (the GPU engine's
  host side), equal to `user_side` request by request (tested).
* `two_tower_vector(model, request)`: the single user vector `u` (D,) of the two-tower baseline,
  which scores `dot(u, dequant(a))`:
      u = T @ concat(x_0, ..., x_{E-1}) + t     when model.npz carries `T` and `t` (a linear tower,
                                                so it can be fitted by least squares)
      u = mean over e of U[e]                   otherwise (untrained fallback)
* `EmbeddingTable` and `quantize`: stored ad embeddings in fp32, fp16, or int8 with one float32 scale
  per ad (`dequant(a) = scale * a`; scale = max|a| / 127 per row, values = rint(a / scale)).

The per-ad half of the formula (FiLM, gate, routing, score) lives in `andromeda_nb.reference` (float64)
and in the GPU kernels.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from .constants import (
    CONTEXT_WIDTH,
    DEFAULT_D,
    DEFAULT_E,
    DEFAULT_F,
    DEFAULT_TOP_EXPERTS,
    DEVICE_PLATFORMS,
    HOUR_BUCKETS,
    PRECISIONS,
    PUBLISHER_PLATFORMS,
    SIGNAL_WIDTH,
    USER_OS,
)
from .types import Context, Request

MODEL_ARRAYS = ("W", "b", "K", "A", "B")  # required in model.npz
TWO_TOWER_ARRAYS = ("T", "t")  # optional in model.npz, both or neither
STORED_DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
PRECISION_OF_DTYPE = {np.dtype(dtype): name for name, dtype in STORED_DTYPES.items()}
INT8_LEVELS = 127  # int8 values lie in [-127, 127]

# Scales of the seeded weights (MoeModel.init), chosen for signals ~ N(0, 1) and ad embeddings with
# entries ~ N(0, 1/D): expert outputs U are tanh of unit-variance inputs; gate logits g have a standard
# deviation near 1, so the k-th and (k+1)-th logits rarely lie within GATE_TIE_ATOL; scores are O(1);
# gamma stays within about [0.5, 1.5] and beta is comparable to one embedding entry.
_W_STD = 1.0  # times 1/sqrt(S): W[e] @ x_e has unit variance
_B_STD = 0.1
_K_STD = 10.0  # times 1/sqrt(D)
_A_STD = 0.25
_FILM_SHIFT_STD = 0.05


class ModelError(ValueError):
    """Weights or stored embeddings that break DESIGN section 3 (shape, dtype, values)."""


# --- weights --------------------------------------------------------------------------------------


def _check_array(name: str, value, ndim: int, where: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ModelError(f"{where}{name}: expected a numpy array, got {type(value).__name__}")
    if value.dtype != np.float32:
        raise ModelError(f"{where}{name}: dtype must be float32, got {value.dtype} "
                         f"(cast with .astype(np.float32))")
    if value.ndim != ndim:
        raise ModelError(f"{where}{name}: expected {ndim} dimensions, got shape {value.shape}")
    if not np.all(np.isfinite(value)):
        raise ModelError(f"{where}{name}: contains NaN or infinite values")
    return np.ascontiguousarray(value)


@dataclass
class MoeModel:
    W: np.ndarray  # float32 (E, D, S)
    b: np.ndarray  # float32 (E, D)
    K: np.ndarray  # float32 (E, D, D)
    A: np.ndarray  # float32 (F, D, C)
    B: np.ndarray  # float32 (F, D, C)
    top_k: int = DEFAULT_TOP_EXPERTS
    T: np.ndarray | None = None  # float32 (D, E*S), two-tower weights (optional)
    t: np.ndarray | None = None  # float32 (D,), two-tower bias (optional)
    source: str = ""  # where the weights came from, for error messages

    def __post_init__(self):
        where = f"{self.source}: " if self.source else ""
        self.W = _check_array("W", self.W, 3, where)
        self.b = _check_array("b", self.b, 2, where)
        self.K = _check_array("K", self.K, 3, where)
        self.A = _check_array("A", self.A, 3, where)
        self.B = _check_array("B", self.B, 3, where)
        E, D, S = self.W.shape
        F, _, C = self.A.shape
        expected = {"b": (E, D), "K": (E, D, D), "A": (F, D, CONTEXT_WIDTH), "B": (F, D, CONTEXT_WIDTH)}
        for name, shape in expected.items():
            got = getattr(self, name).shape
            if got != shape:
                raise ModelError(f"{where}{name}: expected shape {shape} (E={E}, D={D}, F={F}, "
                                 f"C={CONTEXT_WIDTH}) from W {self.W.shape} and A, got {got}")
        if min(E, D, S, F) < 1:
            raise ModelError(f"{where}empty weights: E={E}, D={D}, S={S}, F={F}")
        if isinstance(self.top_k, (bool, np.bool_)) or not isinstance(self.top_k, (int, np.integer)):
            raise ModelError(f"{where}top_k: expected an int, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if not 1 <= self.top_k <= E:
            raise ModelError(f"{where}top_k: must be between 1 and E={E}, got {self.top_k}")
        if (self.T is None) != (self.t is None):
            raise ModelError(f"{where}two-tower weights: T and t must both be present or both absent")
        if self.T is not None:
            self.T = _check_array("T", self.T, 2, where)
            self.t = _check_array("t", self.t, 1, where)
            if self.T.shape != (D, E * S):
                raise ModelError(f"{where}T: expected shape {(D, E * S)}, got {self.T.shape}")
            if self.t.shape != (D,):
                raise ModelError(f"{where}t: expected shape {(D,)}, got {self.t.shape}")

    # sizes
    @property
    def E(self) -> int:
        return self.W.shape[0]

    @property
    def D(self) -> int:
        return self.W.shape[1]

    @property
    def S(self) -> int:
        return self.W.shape[2]

    @property
    def F(self) -> int:
        return self.A.shape[0]

    @property
    def C(self) -> int:
        return self.A.shape[2]

    @property
    def has_two_tower(self) -> bool:
        return self.T is not None

    @classmethod
    def init(cls, seed: int, D: int = DEFAULT_D, E: int = DEFAULT_E, F: int = DEFAULT_F,
             top_k: int = DEFAULT_TOP_EXPERTS, S: int = SIGNAL_WIDTH) -> "MoeModel":
        """Seeded random weights (no two-tower weights: `two_tower_vector` uses its fallback)."""
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, 0x40E])
        C = CONTEXT_WIDTH

        def normal(shape, std):
            return (rng.standard_normal(shape) * std).astype(np.float32)

        return cls(
            W=normal((E, D, S), _W_STD / math.sqrt(S)),
            b=normal((E, D), _B_STD),
            K=normal((E, D, D), _K_STD / math.sqrt(D)),
            A=normal((F, D, C), _A_STD),
            B=normal((F, D, C), _FILM_SHIFT_STD),
            top_k=top_k,
            source=f"MoeModel.init(seed={seed})",
        )

    def with_two_tower(self, T: np.ndarray, t: np.ndarray) -> "MoeModel":
        """A copy that carries the given two-tower weights T (D, E*S), t (D,) float32."""
        return MoeModel(self.W, self.b, self.K, self.A, self.B, self.top_k,
                        np.asarray(T, np.float32), np.asarray(t, np.float32), self.source)

    def save(self, path) -> None:
        """Write model.npz: W, b, K, A, B (float32), top_k (int64 scalar), and T, t when present."""
        arrays = {name: getattr(self, name) for name in MODEL_ARRAYS}
        arrays["top_k"] = np.int64(self.top_k)
        if self.has_two_tower:
            arrays["T"], arrays["t"] = self.T, self.t
        path = os.fspath(path)
        with open(path, "wb") as fh:  # a file object: np.savez would otherwise append ".npz"
            np.savez(fh, **arrays)

    @classmethod
    def load(cls, path) -> "MoeModel":
        """Read model.npz; `top_k` defaults to 2 when the file has none. Raises ModelError naming the
        file and the array when something is missing or has the wrong shape or dtype."""
        path = os.fspath(path)
        wanted = f"model.npz is a NumPy .npz archive (a zip file) of the arrays {', '.join(MODEL_ARRAYS)}"
        try:
            with open(path, "rb") as fh:
                head = fh.read(64)
        except FileNotFoundError:
            raise ModelError(f"{path}: no such model file") from None
        except OSError as exc:
            raise ModelError(f"{path}: cannot be read ({exc.strerror})") from None
        if not head.startswith(b"PK"):  # what the file looks like instead, in the reader's terms
            text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
            looks = ("JSON text (an ads or requests file?)" if text[:1] in (b"{", b"[") else
                     "a single NumPy array (.npy)" if head.startswith(b"\x93NUMPY") else
                     "an empty file" if not head else "not a zip archive")
            raise ModelError(f"{path}: not a model: it is {looks}; {wanted}")
        try:
            npz = np.load(path, allow_pickle=False)
        except Exception as exc:  # a zip that numpy cannot read (truncated, not an archive of arrays)
            raise ModelError(f"{path}: not a readable model.npz ({type(exc).__name__}); {wanted}") from None
        with npz:
            missing = [name for name in MODEL_ARRAYS if name not in npz.files]
            if missing:
                raise ModelError(f"{path}: missing array(s) {', '.join(missing)} "
                                 f"(model.npz needs {', '.join(MODEL_ARRAYS)})")
            try:
                arrays = {name: npz[name] for name in MODEL_ARRAYS}
            except ValueError:  # numpy's advice is for programmers: say what the file holds instead
                raise ModelError(f"{path}: an array holds Python objects, not numbers; {wanted}") from None
            except Exception as exc:  # a damaged member
                raise ModelError(f"{path}: an array cannot be read ({type(exc).__name__}); {wanted}") from None
            top_k = DEFAULT_TOP_EXPERTS
            if "top_k" in npz.files:
                raw = npz["top_k"]
                if raw.shape != () or raw.dtype.kind not in "iu":
                    raise ModelError(f"{path}: top_k: expected an integer scalar, "
                                     f"got {raw.dtype} {raw.shape}")
                top_k = int(raw)
            T = npz["T"] if "T" in npz.files else None
            t = npz["t"] if "t" in npz.files else None
        return cls(**arrays, top_k=top_k, T=T, t=t, source=path)


# --- user side --------------------------------------------------------------------------------------


def _one_hot_index(field: str, value, universe) -> int:
    try:
        return universe.index(value)
    except ValueError:
        raise ModelError(f"context.{field}: unknown value {value!r}; expected one of "
                         f"{', '.join(universe)}") from None


def hour_bucket(time: int) -> int:
    """The hour-of-day bucket of DESIGN section 3: (time // 3600) % 24 // 6, in 0..3."""
    return (int(time) // 3600) % 24 // 6


_CONTEXT_FIELDS = (("publisher_platform", PUBLISHER_PLATFORMS), ("device_platform", DEVICE_PLATFORMS),
                   ("user_os", USER_OS))


# a context vector's groups (publisher, device, os, hour bucket) as column bounds: 0, 4, 7, 13, 17
_GROUP_BOUNDS = tuple(int(b) for b in np.cumsum([0, *(len(u) for _, u in _CONTEXT_FIELDS), HOUR_BUCKETS]))
N_CONTEXTS = int(np.prod(np.diff(_GROUP_BOUNDS)))  # one-hot contexts: 4 x 3 x 6 x 4 = 288
# column j of a context vector, set, adds its value within its group times the group's place value
_CONTEXT_PLACE = np.concatenate([np.arange(hi - lo) * int(np.prod(np.diff(_GROUP_BOUNDS)[g + 1:]))
                                 for g, (lo, hi) in enumerate(zip(_GROUP_BOUNDS, _GROUP_BOUNDS[1:]))]).astype(np.float64)


def context_vectors(publisher, device, os, time) -> np.ndarray:
    """float64 (n, 17): `context_vector` of n contexts given as arrays (indexes into the constants'
    tuples, and times)."""
    publisher, device, os = (np.asarray(a, np.int64) for a in (publisher, device, os))
    n = len(publisher)
    rows = np.arange(n)
    c = np.zeros((n, CONTEXT_WIDTH), np.float64)
    offset = 0
    for codes, (_, universe) in zip((publisher, device, os), _CONTEXT_FIELDS):
        c[rows, offset + codes] = 1.0
        offset += len(universe)
    c[rows, offset + (np.asarray(time, np.int64) // 3600) % 24 // 6] = 1.0  # hour_bucket
    assert offset + HOUR_BUCKETS == CONTEXT_WIDTH
    return c


def _contexts_as_arrays(contexts) -> tuple[list, ...]:
    """The arguments of `context_vectors` for Context objects (ModelError naming an unknown value)."""
    codes = [[_one_hot_index(field, getattr(c, field), universe) for c in contexts]
             for field, universe in _CONTEXT_FIELDS]
    return (*codes, [c.time for c in contexts])


def context_vector(context: Context) -> np.ndarray:
    """float64 (17,): one-hot publisher_platform (4) ++ device_platform (3) ++ user_os (6) ++ hour
    bucket (4), each in the order of `andromeda_nb.constants`."""
    return context_vectors(*_contexts_as_arrays([context]))[0]


@dataclass(frozen=True)
class UserSide:
    """The per-request tables, float64 (cast to float32 for kernels)."""

    U: np.ndarray  # (E, D) expert outputs
    Q: np.ndarray  # (E, D) gate keys
    gamma: np.ndarray  # (F, D) FiLM scale per format
    beta: np.ndarray  # (F, D) FiLM shift per format
    c: np.ndarray  # (C,) context vector
    top_k: int

    @property
    def E(self) -> int:
        return self.U.shape[0]

    @property
    def D(self) -> int:
        return self.U.shape[1]

    @property
    def F(self) -> int:
        return self.gamma.shape[0]

    def float32(self) -> dict[str, np.ndarray]:
        """The four tables as C-contiguous float32 arrays, keyed U, Q, gamma, beta."""
        return {name: np.ascontiguousarray(getattr(self, name), np.float32)
                for name in ("U", "Q", "gamma", "beta")}


def _signals(model: MoeModel, request: Request) -> np.ndarray:
    x = np.asarray(request.signals)
    if x.shape != (model.E, model.S):
        raise ModelError(f"request {request.request_id}: signals: expected shape ({model.E}, {model.S}) "
                         f"(E groups of S floats), got {x.shape}")
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ModelError(f"request {request.request_id}: signals: contains NaN or infinite values")
    return x


def user_side(model: MoeModel, request: Request) -> UserSide:
    """The per-request tables of DESIGN section 3, float64."""
    x = _signals(model, request)  # (E, S)
    c = context_vector(request.context)
    W, b, K = (np.asarray(a, np.float64) for a in (model.W, model.b, model.K))
    A, B = np.asarray(model.A, np.float64), np.asarray(model.B, np.float64)
    U = np.tanh(np.einsum("eds,es->ed", W, x) + b)
    Q = np.einsum("edj,ej->ed", K, U)
    gamma = 1.0 + np.tanh(A @ c)
    beta = B @ c
    return UserSide(U=U, Q=Q, gamma=gamma, beta=beta, c=c, top_k=model.top_k)


def user_sides(model: MoeModel, requests) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`user_side` of every request at once, float64: U, Q (R, E, D) and gamma, beta (R, F, D).
    The per-expert and per-format products are batched matrix products (BLAS), not `einsum`
    contractions, which numpy does not hand to BLAS: a batch of 64 costs a seventh of the time."""
    inputs = getattr(requests, "model_inputs", None)  # requests as arrays: their signals and contexts whole
    if inputs is None:
        requests = list(requests)
    W, b, K = (np.asarray(a, np.float64) for a in (model.W, model.b, model.K))
    E, D = b.shape
    F = model.A.shape[0]
    if not requests:
        return np.zeros((0, E, D)), np.zeros((0, E, D)), np.zeros((0, F, D)), np.zeros((0, F, D))
    if inputs is not None:
        x, c = inputs()  # (R, E, S), (R, C)
        if x.shape[1:] != (model.E, model.S) or not np.all(np.isfinite(x)):
            x = _batch_signals(model, list(requests))  # names the first bad request
    else:
        x = _batch_signals(model, requests)
        c = context_vectors(*_contexts_as_arrays([r.context for r in requests]))
    # (E, R, S) @ (E, S, D) -> (E, R, D), then requests first
    U = np.tanh(np.matmul(x.transpose(1, 0, 2), W.transpose(0, 2, 1)).transpose(1, 0, 2) + b)
    Q = np.matmul(U.transpose(1, 0, 2), K.transpose(0, 2, 1)).transpose(1, 0, 2)
    which = _context_numbers(c)
    if which is None:  # a context vector that is not one-hot: its FiLM computed
        return U, Q, *_film(model, c)
    gamma_all, beta_all = _film_tables(model)  # FiLM depends on the context alone: looked up
    return U, Q, gamma_all[which], beta_all[which]


def _film(model: "MoeModel", c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 (R, F, D) twice: gamma and beta of DESIGN section 3 for context vectors c (R, C), as
    one matrix product each."""
    A, B = np.asarray(model.A, np.float64), np.asarray(model.B, np.float64)
    F, D = A.shape[0], A.shape[1]
    gamma = 1.0 + np.tanh((c @ A.reshape(F * D, -1).T).reshape(len(c), F, D))
    beta = (c @ B.reshape(F * D, -1).T).reshape(len(c), F, D)
    return gamma, beta


def _context_numbers(c: np.ndarray) -> np.ndarray | None:
    """int64 (R,): the number of each row's context among the N_CONTEXTS one-hot contexts (publisher,
    device, os, hour bucket, mixed radix in that order), or None when a row is not one-hot in every
    group (then the caller computes its FiLM tables)."""
    if not (np.all((c == 0.0) | (c == 1.0)) and np.all(np.add.reduceat(c, _GROUP_BOUNDS[:-1], axis=1) == 1.0)):
        return None
    return (c @ _CONTEXT_PLACE).astype(np.int64)  # exact: a sum of four small integers


def _film_tables(model: "MoeModel") -> tuple[np.ndarray, np.ndarray]:
    """float64 (N_CONTEXTS, F, D) twice: gamma and beta of DESIGN section 3 for every one-hot context,
    in `_context_numbers`' order, made once per model by the batch's own formula (a row of the matrix
    product is its four columns of A or B summed) and kept on it with the arrays they came from: a
    model given new A or B arrays makes them again (the weights are never changed in place)."""
    kept = getattr(model, "_film", None)
    if kept is not None and kept[0] is model.A and kept[1] is model.B:
        return kept[2], kept[3]
    # every context, the last group fastest; an hour bucket h as a time in it (h * 6 hours)
    publisher, device, os, hour = np.indices(tuple(np.diff(_GROUP_BOUNDS))).reshape(len(_GROUP_BOUNDS) - 1, -1)
    gamma, beta = _film(model, context_vectors(publisher, device, os, hour * (6 * 3600)))
    object.__setattr__(model, "_film", (model.A, model.B, gamma, beta))
    return gamma, beta


def _batch_signals(model: MoeModel, requests) -> np.ndarray:
    """float64 (R, E, S): every request's signals, checked as `_signals` checks one (the first bad
    request is named)."""
    try:
        x = np.stack([np.asarray(r.signals) for r in requests]).astype(np.float64)
    except ValueError:  # shapes differ: name the first request whose shape is wrong
        x = None
    if x is None or x.shape[1:] != (model.E, model.S) or not np.all(np.isfinite(x)):
        return np.stack([_signals(model, r) for r in requests])
    return x


def two_tower_vector(model: MoeModel, request: Request) -> np.ndarray:
    """float64 (D,): the two-tower user vector. With trained weights, u = T @ x.reshape(E*S) + t
    (signal groups concatenated in expert order); without them, the mean of the expert outputs U."""
    if model.has_two_tower:
        x = _signals(model, request).reshape(-1)
        return np.asarray(model.T, np.float64) @ x + np.asarray(model.t, np.float64)
    return user_side(model, request).U.mean(axis=0)


# --- stored embeddings ------------------------------------------------------------------------------


@dataclass
class EmbeddingTable:
    """Stored ad embeddings: `values` (N, D) of the precision's dtype, `scale` (N,) float32 (all ones
    unless int8). Row i dequantizes to scale[i] * values[i]."""

    values: np.ndarray
    scale: np.ndarray
    precision: str

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ModelError(f"precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        want = np.dtype(STORED_DTYPES[self.precision])
        if not isinstance(self.values, np.ndarray) or self.values.ndim != 2:
            raise ModelError(f"embedding values: expected a 2-D array (N, D), got "
                             f"{getattr(self.values, 'shape', type(self.values).__name__)}")
        if self.values.dtype != want:
            raise ModelError(f"embedding values: precision {self.precision} stores {want}, "
                             f"got {self.values.dtype}")
        scale = np.asarray(self.scale)
        if scale.shape != (self.values.shape[0],) or scale.dtype != np.float32:
            raise ModelError(f"embedding scale: expected float32 ({self.values.shape[0]},), "
                             f"got {scale.dtype} {scale.shape}")
        if self.precision != "int8" and not np.all(scale == 1.0):
            raise ModelError(f"embedding scale: must be all ones for {self.precision}")
        if not np.all(np.isfinite(scale)) or np.any(scale < 0):
            raise ModelError("embedding scale: must be finite and non-negative")
        self.values = np.ascontiguousarray(self.values)
        self.scale = np.ascontiguousarray(scale)

    def __len__(self) -> int:
        return self.values.shape[0]

    @property
    def D(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        """Stored bytes: values, plus the scales for int8."""
        return self.values.nbytes + (self.scale.nbytes if self.precision == "int8" else 0)

    def dequantize(self, rows=None) -> np.ndarray:
        """float64 (len(rows), D) = scale * float64(values), for the given rows (all when None)."""
        if rows is None:
            return self.scale.astype(np.float64)[:, None] * self.values.astype(np.float64)
        rows = np.asarray(rows, np.int64)
        return (self.scale[rows].astype(np.float64)[:, None]
                * self.values[rows].astype(np.float64))

    def take(self, rows) -> "EmbeddingTable":
        rows = np.asarray(rows, np.int64)
        return EmbeddingTable(self.values[rows], self.scale[rows], self.precision)

    @classmethod
    def empty(cls, dim: int, precision: str) -> "EmbeddingTable":
        return cls(np.empty((0, dim), STORED_DTYPES[precision]), np.empty(0, np.float32), precision)


def quantize(emb_f32, precision: str) -> EmbeddingTable:
    """Store float32 embeddings (N, D) at a precision. fp32 copies; fp16 rounds to nearest; int8 keeps
    scale = float32(max|a| / 127) per row and values = rint(a / scale) clipped to [-127, 127] (a row of
    zeros gets scale 0 and values 0). Inputs of other float dtypes are first cast to float32."""
    if precision not in PRECISIONS:
        raise ModelError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    a = np.asarray(emb_f32)
    if a.ndim != 2:
        raise ModelError(f"embeddings: expected a 2-D array (N, D), got shape {a.shape}")
    a = a.astype(np.float32, copy=False)
    if not np.all(np.isfinite(a)):
        bad = int(np.flatnonzero(~np.all(np.isfinite(a), axis=1))[0])
        raise ModelError(f"embeddings: row {bad} contains NaN or infinite values")
    n = a.shape[0]
    if precision == "fp32":
        return EmbeddingTable(a.copy(), np.ones(n, np.float32), precision)
    if precision == "fp16":
        if n and float(np.abs(a).max()) > float(np.finfo(np.float16).max):
            bad = int(np.flatnonzero(np.abs(a).max(axis=1) > np.finfo(np.float16).max)[0])
            raise ModelError(f"embeddings: row {bad} has a value beyond the float16 range")
        return EmbeddingTable(a.astype(np.float16), np.ones(n, np.float32), precision)
    a64 = a.astype(np.float64)
    scale = (np.abs(a64).max(axis=1, initial=0.0) / INT8_LEVELS).astype(np.float32)
    divisor = scale.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(divisor > 0, np.rint(a64 / np.where(divisor > 0, divisor, 1.0)), 0.0)
    q = np.clip(q, -INT8_LEVELS, INT8_LEVELS).astype(np.int8)
    return EmbeddingTable(q, scale, precision)


def ad_embedding_of(ad, seed: int, dim: int) -> np.ndarray:
    """float32 (dim,): an ad's own embedding, or the one derived from its id and the corpus seed when it
    carries none (DESIGN section 2). ModelError when it has the wrong length."""
    emb = ad.embedding
    if emb is None:
        from .derive import ad_embedding

        emb = ad_embedding(ad.ad_id, seed, dim)
    emb = np.asarray(emb, np.float32)
    if emb.shape != (dim,):
        raise ModelError(f"ad {ad.ad_id}: embedding: expected {dim} values, got {emb.shape}")
    return emb


__all__ = [
    "EmbeddingTable",
    "ModelError",
    "MoeModel",
    "UserSide",
    "ad_embedding_of",
    "context_vector",
    "hour_bucket",
    "quantize",
    "two_tower_vector",
    "user_side",
    "user_sides",
]
