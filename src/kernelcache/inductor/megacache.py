"""torch's Mega-Cache blobs into kernelcache: a CI job or an image build pre-warms a team.

``torch.compiler.save_cache_artifacts()`` returns one blob holding every
artifact this process compiled (FX graphs, AOTAutograd entries, autotune
results, ...). :func:`publish_artifacts` stores its FX graph and AOTAutograd
artifacts as the entries torch's remote caches ask for, so every machine with
:mod:`kernelcache.inductor` installed hits them, locally or through the team
tier. Reading the blob's container unpickles nothing; the payloads stay opaque
bytes, loaded later by torch only under the integration's trust rule.

Command line: ``kernelcache-cli import --inductor FILE`` (the file written from
``save_cache_artifacts()[0]``).
"""

from __future__ import annotations

import base64
import json
from collections import Counter

from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.inductor.backend import VALUE, cache_id, entry_key

#: Mega-Cache artifact type -> the remote cache id torch reads it back under (torch 2.13.0).
REMOTE_IDS = {"inductor": "fx-graph-v1", "aot_autograd": "autograd-experimental"}


def remote_key(artifact_type: str, key: str) -> str:
    """The key torch's ``RedisRemoteCache`` builds for this artifact (``pt2:<id>::<key>:c1``)."""
    return f"pt2:{REMOTE_IDS[artifact_type]}::{key}:c1"


def publish_artifacts(blob: bytes | None = None, cache: Cache | None = None) -> dict[str, int]:
    """Store a Mega-Cache blob's FX graph and AOTAutograd artifacts in ``cache``.

    ``blob`` defaults to this process's ``torch.compiler.save_cache_artifacts()``;
    ``cache`` to :func:`kernelcache.inductor.get_cache`. Returns how many
    artifacts of each type were stored, and how many were ``skipped`` (types
    that are not torch remote-cache entries). Raises ``ValueError`` for a blob
    torch cannot read.
    """
    from torch.compiler._cache import CacheArtifactManager

    if blob is None:
        import torch

        saved = torch.compiler.save_cache_artifacts()
        blob = b"" if saved is None else saved[0]
    if cache is None:
        from kernelcache import inductor

        cache = inductor.get_cache()
    artifacts = CacheArtifactManager.deserialize(blob) if blob else {}
    if artifacts is None:
        raise ValueError("not a torch.compiler.save_cache_artifacts() blob")
    stored: Counter[str] = Counter()
    for kind, items in artifacts.items():
        if kind not in REMOTE_IDS:
            stored["skipped"] += len(items)
            continue
        for artifact in items:
            torch_key = remote_key(kind, artifact.key)
            document = {
                "data": base64.b64encode(artifact.content).decode("ascii"),
                "time_taken_ms": 0,
            }
            value = json.dumps(document).encode("ascii")
            meta = {"torch_cache": cache_id(torch_key)}
            cache.put(entry_key(torch_key), Entry({VALUE: value}, meta=meta))
            stored[kind] += 1
    return dict(stored)
