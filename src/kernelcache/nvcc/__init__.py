"""``kernelcache nvcc ARGS...``: a caching compiler launcher for nvcc, like ccache.

``client.py`` is the ``kernelcache`` executable's fast path (it talks to the
per-user server in ``server.py``); ``launcher.py`` runs a call in-process
(control flow and the direct lookup), with the command line in ``args.py``
and ``options.py``, keys in ``key.py``, one call's keys and lookup in
``job.py``, dependency files and manifests in ``deps.py``, failed include
lookups and time macros in ``includes.py``, nvcc's preprocessing in
``preprocess.py``, what a hit writes in ``outputs.py``, the miss in
``miss.py`` and the single-flight claims around it in ``flight.py``.

Nothing is imported here: the client must not pay for the launcher.
"""
