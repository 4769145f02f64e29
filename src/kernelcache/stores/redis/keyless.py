"""What a machine that cannot verify the team's signed entries may do (issue 20).

One laptop without ``KERNELCACHE_SECRET`` (or with a wrong one) used to find
every signed entry unverifiable, compile, and write over it; the signed
machines then found their own key forged, compiled and wrote back, and so on:
the team's hits became misses. Now such a machine, in a signed namespace:

- reads nothing signed (counted ``unverifiable``, or ``forged`` for another
  secret's), and never deletes a signed entry while looking;
- never replaces a signed entry: Redis refuses the write atomically (the
  publish script's keep-signed check, on the record's own key, so it works on
  a cluster too), the refusal is counted ``not_replaced`` and said once;
- may add entries where none is; machines with the secret ignore those
  (counted ``forged``) and replace them;
- may remove entries only when a person asks (``kernelcache clear --remote``,
  ``prune --remote``, ``Cache.delete``): who may delete is Redis's ACL's to say.
"""

from __future__ import annotations

import logging
from typing import Any

#: (store description, cause) pairs already said by this process.
_SAID: set[tuple[str, str]] = set()


def say_once(store: Any, cause: str) -> None:
    """Warn once per store and cause that a signed entry was kept, naming why."""
    said = (repr(store), cause)
    if said in _SAID:
        return
    _SAID.add(said)
    fix = (
        "set KERNELCACHE_SECRET to the team's secret"
        if "no secret" in cause
        else "check that KERNELCACHE_SECRET is the team's"
    )
    logging.getLogger("kernelcache").warning(
        "kernelcache: %r holds signed entries and this machine %s: it neither reads nor "
        "replaces them (%s; said once)",
        store,
        cause,
        fix,
    )
