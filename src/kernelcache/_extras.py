"""Optional dependencies: an integration whose package is missing says which extra to install."""

from __future__ import annotations


def missing(exc: ModuleNotFoundError, *, package: str, extra: str, feature: str) -> ImportError:
    """What to raise when importing an integration's dependency failed with ``exc``.

    Used as ``except ModuleNotFoundError as exc: raise missing(exc, ...) from exc``
    around the integration's first third-party import, so that
    ``import kernelcache.triton`` without Triton says what to install instead
    of a bare ``No module named 'triton'``. A missing module that is not
    ``package`` itself (a broken installation) is passed through unchanged.
    """
    name = exc.name or ""
    if (
        name != package
        and not name.startswith(package + ".")
        and not package.startswith(name + ".")
    ):
        return exc
    return ModuleNotFoundError(
        f"{feature} needs {package!r}, which is not installed: pip install 'kernelcache[{extra}]'",
        name=name,
    )
