"""One kernel written once, compiled in several forms: a plain function (the template) whose free names
are bound per form, e.g. which device functions a batched match kernel calls, how the radix select
reads a key, or which per-ad loop a CPU scorer driver runs. numba freezes a function's globals as
constants when it compiles it (`numba.njit` or `numba.cuda.jit`), so each form is compiled as if it
had been written out by hand, and each gets its own name (numba's cache keeps forms apart by name;
like any cached numba function, a form is recompiled when the template's file changes, not when
only a bound function's file does).
"""

from __future__ import annotations

import types


def specialize(template, name: str, **bound):
    """A copy of the plain function `template` named `name` whose free names read `bound` (the rest of
    its module's globals unchanged). Compile the copy with `numba.njit` or `numba.cuda.jit`."""
    namespace = {**template.__globals__, **bound}
    fn = types.FunctionType(template.__code__, namespace, name, template.__defaults__, template.__closure__)
    fn.__qualname__ = name
    fn.__doc__ = template.__doc__
    return fn


__all__ = ["specialize"]
