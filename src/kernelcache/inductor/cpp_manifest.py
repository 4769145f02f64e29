"""Manifests of Inductor's C++ builds: a hit with no compiler run, ccache's direct mode.

A build's key holds the digest of its directives preprocessed (the header
scan, :mod:`kernelcache.inductor.headers`): a ``g++ -E`` run per distinct flag
set, which a fresh machine pays even when the team tier holds every build
(issue 40: four scans cost more than the two builds they saved). So, as the
nvcc launcher does (:mod:`kernelcache.nvcc.deps`, whose manifests these are),
a *manifest* is stored under the build's *direct key*
(:func:`kernelcache.inductor.cpp_keys.direct_key`: every field but the
headers, computed without running anything). Each variant lists the headers
the scan read (absolute paths) with their content digests and stat
signatures, the include lookups that found nothing
(:func:`kernelcache.nvcc.includes.absent`: a header created earlier in the
search path), and the key of the result.

A lookup checks each variant as the launcher does (:func:`kernelcache.nvcc.deps.matches`:
a ``stat`` per header while its signature is the recorded one and old enough
to vouch for it, its content hashed otherwise, as on another machine;
:func:`kernelcache.nvcc.includes.still_absent`), and when one holds, restores
its result: no scan, no compile. A header that changed, or a path that does not
exist here (a header under another machine's temporary folder), fails the
variant; without one that holds, the scan decides, as before.

The sources and the ``-include`` header are in the direct key by content, so
their paths (under torch's per-machine cache and header folders) are left out
of the variants; the headers under torch's install are at the same path on
every machine of a team that shares an image or a venv layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.inductor.cpp_keys import Build, Uncacheable, quoted_folder
from kernelcache.inductor.headers import Scan
from kernelcache.nvcc import deps, includes
from kernelcache.nvcc.args import host_search

__all__ = ["lookup", "record", "search_path"]


def lookup(cache: Cache, direct: str, build: Build) -> Entry | None:
    """The result of the first variant under ``direct`` whose headers are unchanged.

    A variant recorded with its inputs' folders (their quoted includes are
    looked up there first: :func:`kernelcache.inductor.cpp_keys.quoted_folder`)
    holds for a build in those folders only.
    """
    folders: str | None = None
    for variant in deps.variants(cache.get(direct)):
        if "folder" in variant:
            folders = build.folders() if folders is None else folders
            if variant["folder"] != folders:
                continue
        if deps.matches(variant.get("deps", []), None) and includes.still_absent(
            variant.get("absent", []), None
        ):
            result = cache.get(str(variant.get("result")))
            if result is not None:
                return result
    return None


def search_path(build: Build, env: Mapping[str, str]) -> includes.SearchPath:
    """Where ``build``'s preprocessor looks for headers (:class:`kernelcache.nvcc.includes.SearchPath`).

    A relative folder is looked up from the working directory, which no key
    holds: such a search is not modelled (no variant; the scan decides).
    """
    found = host_search(build.command)
    search = includes.host_search_path(found.includes, env, absolute=True)
    if found.reason is not None:
        search.unsure = f"the command cannot be followed: {found.reason}"
    return search


def record(
    cache: Cache, direct: str, build: Build, scan: Scan | None, result: str, env: Mapping[str, str]
) -> str | None:
    """Add the variant ``scan`` → ``result`` to the manifest under ``direct``.

    Returns why no variant was added, or ``None``. ``scan`` is ``None`` for a
    link (objects in: no header read, so the direct key says it all).
    """
    rows: list[list[object]] = []
    absent: list[list[object]] = []
    folder = None
    if scan is not None:
        if scan.files is None:
            return "the headers read are not known exactly"
        # A header changed since the scan (or during the compile) is no part of it.
        try:
            recorded = deps.record(scan.files, None, scan.started_ns)
        except OSError as exc:
            return f"a header is gone: {exc.filename}"
        if recorded is None:
            return "a header changed since the scan"
        rows, contents = recorded
        texts = dict(contents)
        for path in build.inputs:
            try:
                with open(path, "rb") as f:
                    texts[path] = f.read()
            except OSError as exc:
                return f"cannot read {path}: {exc.strerror}"
        try:
            if quoted_folder(build, [texts[path] for path in build.inputs]) is not None:
                folder = build.folders()
        except Uncacheable as exc:
            return str(exc)
        try:
            missing = includes.absent(texts, scan.search(search_path(build, env)), scan.started_ns)
        except includes.Unsure as exc:
            return str(exc)
        if missing is None:
            return "a header appeared during the scan"
        absent = includes.watch(missing, None)
    known = deps.variants(cache.get(direct))
    variants = deps.add_variant(known, rows, absent, result, folder)
    if known and known[0] == variants[0]:
        return None  # the newest variant already (a hit on the full key): nothing to write
    cache.put(
        direct, Entry({deps.MANIFEST: json.dumps(variants).encode()}, meta={"kind": "manifest"})
    )
    return None
