"""In-process memo of ``ninetoothed.make`` JIT handles, keyed by content (ninetoothed #161).

A ``make(..., caller="torch")`` call re-runs the arrangement, the code
generator and an import every time (7-45 ms in #161's measurements). The
handle it returns cannot be serialised, so it is memoised in process with
:class:`kernelcache.memoize.Memo`. The key holds what #161 lists: the
arrangement and application functions by fingerprint (source, closure
values, helpers, nested ``functools.partial`` arguments), each tensor's
structure (ndim, symbolic or fixed sizes with their bounds, dtype, jagged
dimension, ``other``, constexpr flag and value), non-tensor elements of the
``tensors`` tuple (e.g. ``ceil_mode`` passed as a third element, #161's
max-pool case), caller, kernel name, warps, stages and the config cap.
Tensor *names* are left out: ninetoothed numbers them globally, so two
equal tensors made at different times have different names but give
interchangeable kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from kernelcache.memoize import Memo

#: Memoised only for JIT handles; AOT calls write files and go to the output cache.
MEMO_CALLER = "torch"


def _plain(value: Any) -> Hashable:
    """A hashable, type-tagged key for a plain value (slices are unhashable before 3.12)."""
    if isinstance(value, slice):
        return ("slice", _plain(value.start), _plain(value.stop), _plain(value.step))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return (type(value).__name__, value)
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"cannot key a ninetoothed.make argument of type {type(value).__qualname__}"
        ) from None
    return (type(value).__qualname__, value)


def _size(size: Any, own_name: str) -> Hashable:
    if isinstance(size, int):
        return ("int", size)
    text = str(size).replace(own_name, "@")
    bounds = tuple(getattr(size, a, None) for a in ("lower_bound", "upper_bound", "power_of_two"))
    return ("symbol", text, bounds)


def tensor_signature(element: Any) -> Hashable:
    """The structure of one element of ``tensors`` (a ninetoothed Tensor or a plain value)."""
    from ninetoothed import Tensor

    if not isinstance(element, Tensor):
        return ("value", _plain(element))
    return (
        "tensor",
        element.ndim,
        tuple(_size(size, element.name) for size in element.shape),
        str(element.dtype),
        element.jagged_dim,
        _plain(element.other),
        bool(element.constexpr),
        _plain(element.value),
    )


class TensorsKey:
    """The ``tensors`` argument, compared and hashed by structure, carrying the tensors."""

    __slots__ = ("signature", "tensors")

    def __init__(self, tensors: Any) -> None:
        self.tensors = tensors
        elements = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        self.signature = (type(tensors).__name__, tuple(map(tensor_signature, elements)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorsKey) and self.signature == other.signature

    def __hash__(self) -> int:
        return hash(self.signature)


class MakeMemo:
    """``make`` with its JIT handles memoised; other callers go straight to ``make``."""

    def __init__(self, make: Callable[..., Any], maxsize: int = 256) -> None:
        self.make = make
        self.memo = Memo(maxsize)
        # One bound-method object: the memo fingerprints a function once per identity.
        self.build = self._build

    def __call__(
        self,
        arrangement: Any,
        application: Any,
        tensors: Any,
        caller: str = "torch",
        kernel_name: str | None = None,
        output_dir: Any = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        max_num_configs: int | None = None,
    ) -> Any:
        if caller != MEMO_CALLER:
            return self.make(
                arrangement, application, tensors, caller=caller, kernel_name=kernel_name,
                output_dir=output_dir, num_warps=num_warps, num_stages=num_stages,
                max_num_configs=max_num_configs,
            )  # fmt: skip
        return self.memo.call(
            self.build,
            arrangement,
            application,
            TensorsKey(tensors),
            caller,
            kernel_name,
            num_warps,
            num_stages,
            max_num_configs,
        )

    def _build(
        self,
        arrangement: Any,
        application: Any,
        tensors: TensorsKey,
        caller: str,
        kernel_name: str | None,
        num_warps: int | None,
        num_stages: int | None,
        max_num_configs: int | None,
    ) -> Any:
        return self.make(
            arrangement, application, tensors.tensors, caller=caller, kernel_name=kernel_name,
            num_warps=num_warps, num_stages=num_stages, max_num_configs=max_num_configs,
        )  # fmt: skip
