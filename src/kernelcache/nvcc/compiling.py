"""A first miss compiled by the calling process, with the warm server doing the bookkeeping.

When the server answers a client "miss", the client starts
``python -m kernelcache.nvcc.launcher`` (:mod:`kernelcache.nvcc.client`),
which would import the whole cache (~0.25 s of CPU) to do what the warm server
already knows how to do. Instead, :func:`run` (imported before anything else
by that module) asks the server for a *plan*; for a command never stored under
a preprocessed key (the cold path of :mod:`kernelcache.nvcc.miss`) the server
answers with the exact nvcc command line, and this process:

1. runs nvcc itself, as the in-process launcher would (``--keep`` into a
   temporary directory, ``-MD -MF`` to a temporary file without a user
   ``-MD``), so it stays the build's child with the build's limits and
   signals; while nvcc runs, it asks nvcc (``--dryrun``) which files its
   preprocessing passes keep;
2. hands nvcc's stdout, stderr and status through, as nvcc gave them;
3. sends the run to the server to *store* (:func:`store`: the same
   :func:`kernelcache.nvcc.miss.finish` as in-process, with every rule of a
   miss), waits for its answer (so the call is counted when it returns), and
   removes its temporary files.

A command whose result was stored under a preprocessed key before may be
found under it again (a comment-only edit), so the server answers
``preprocess``: this process runs nvcc's preprocessing passes (side by side,
beside the build's other jobs, where the one-request-at-a-time server would
queue them) and sends their digests (:func:`lookup`). The server restores
the result stored under them, as a direct hit, or plans the compile above.
An edit-and-rebuild used to start the in-process launcher here, whose import
of the whole cache and second direct lookup cost ~0.2 s per rebuilt file.

With ``KERNELCACHE_NVCC_PREPROCESSED=0`` nothing is preprocessed: every miss is
planned as a compile without ``--keep``, stored under the direct key and its inputs.

Anything else (no server, another answer) returns ``None``: the in-process
launcher runs the call, correct without any server. A store that is lost
(the server died) loses only the entry.
"""

from __future__ import annotations

import os
import posix
import sys
import time

from kernelcache.nvcc import client

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: its import costs each cold object ~10 ms
if TYPE_CHECKING:
    from kernelcache.cache import Cache
    from kernelcache.nvcc.job import Job
    from kernelcache.settings import Settings

#: The protocol of these requests: ``[COMPILE, step, fields..., cwd, dir, umask, argc, argv..., env...]``.
#: 2: the ``compile`` answer says whether to keep the preprocessed files.
COMPILE = b"kernelcache-launcher-compile/2"
#: Seconds a plan is waited for at most (a warm server answers in milliseconds).
PLAN_TIMEOUT = 2.0
#: How many fields each step carries before the request proper.
STEPS = {b"plan": 0, b"lookup": 2, b"store": 8, b"abandon": 0}


def run(argv: list[str]) -> int | None:
    """nvcc's status once this call was compiled (or hit) through the server; ``None``: not done."""
    env = dict(os.environb)
    if client.is_false(env.get(b"KERNELCACHE_SERVER")) or client.is_true(
        env.get(b"KERNELCACHE_READONLY")
    ):
        return None
    cwd = posix.getcwdb()
    directory = client.cache_dir(env, cwd)
    if directory is None:
        return None
    args = [os.fsencode(a) for a in argv]
    # Asked after a server answered this process (before its exec) with no
    # hit, for any reason: one that hung or answered oddly costs at most this.
    reply = client.ask(directory, args, cwd, [COMPILE, b"plan"], PLAN_TIMEOUT)
    if reply and reply[0] == b"preprocess" and len(reply) >= 3:
        reply = _lookup(directory, (args, cwd), env, reply[1:])
    if reply and reply[0] == b"hit" and len(reply) == 4 and reply[1].isdigit():
        client.write_all(1, reply[2])
        client.write_all(2, reply[3])
        return int(reply[1])
    if reply and reply[0] == b"plain" and len(reply) == 2 and reply[1]:
        # Counted by the server as uncacheable (or the cache is disabled): nvcc as it is.
        try:
            os.execv(reply[1], [reply[1], *args[1:]])
        except OSError as exc:
            client.write_all(2, b"kernelcache: cannot run %s: %s\n" % (reply[1], str(exc).encode()))
            return 127
    if reply and reply[0] == b"compile" and len(reply) >= 4:
        nvcc = os.fsdecode(reply[1])
        status = _compile(
            directory, (args, cwd), nvcc, (reply[2] == b"1", reply[3] == b"1"), reply[4:]
        )
        if status is not None:
            return status
    # The in-process launcher takes over. The server may hold this call's flight claim (a
    # plan answered after we stopped waiting, a compile that could not start): give it
    # back, or the launcher would wait for its own compile (nvcc.flight).
    client.ask(directory, args, cwd, [COMPILE, b"abandon"], PLAN_TIMEOUT)
    return None


def _lookup(
    directory: bytes, call: tuple[list[bytes], bytes], env: dict[bytes, bytes], plan: list[bytes]
) -> list[bytes] | None:
    """Preprocess as nvcc would (``plan``: nvcc, the basedir, the dry run's arguments) and
    ask the server for a result stored under the digests: its ``hit``, or the ``compile``."""
    from kernelcache.nvcc import preprocess

    started = time.time_ns()  # before preprocessing: an edit after it is a race
    basedir = os.fsdecode(plan[1]) or None
    found = preprocess.digests_of(
        os.fsdecode(plan[0]),
        [os.fsdecode(a) for a in plan[2:]],
        {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
        basedir,
    )
    # No digests (the preprocessor failed: the compile will say why): the server plans the compile.
    digests = b",".join(d.encode() for d in found or [])
    return client.ask(directory, call[0], call[1], [COMPILE, b"lookup", b"%d" % started, digests])


def _compile(
    directory: bytes,
    call: tuple[list[bytes], bytes],
    nvcc: str,
    how: tuple[bool, bool],
    planned: list[bytes],
) -> int | None:
    """Run the planned compile (``how``: with the launcher's own ``-MD``, keeping the
    preprocessed files) and send it to the server to store; nvcc's status."""
    from kernelcache.nvcc import procs

    own_md, keep = how
    args = [os.fsdecode(a) for a in planned]
    try:
        private = procs.make_private_dir()
    except OSError:
        return None  # no temporary directory: the in-process launcher says why
    # Both in this user's own new directory: nothing else can be named so.
    keep_dir, own_dep = os.path.join(private, "keep"), os.path.join(private, "deps.d")
    try:
        try:
            posix.mkdir(keep_dir, 0o700)
        except OSError:
            return None
        kept = ["--keep", "--keep-dir", keep_dir]
        extra = [*(["-MD", "-MF", own_dep] if own_md else []), *(kept if keep else [])]
        started = time.time_ns()  # as the in-process miss: an edit after it is a race
        # The dry run says which kept files its preprocessing passes wrote: asked beside
        # the compile, which it does not slow down (~10 ms of a second's work).
        commands = [[nvcc, *args, *extra]]
        if keep:
            commands.append([nvcc, *args, *kept, "--dryrun"])
        ran, *asked = procs.run_all(commands)
        elapsed = (time.time_ns() - started) / 1e9
        assert ran is not None  # no timeout was given
        status, stdout, stderr = ran
        dryrun = asked[0][2] if asked and asked[0] is not None and asked[0][0] == 0 else b""
        client.write_all(1, stdout)
        client.write_all(2, stderr)
        fields = [b"%d" % started, repr(elapsed).encode(), b"%d" % status]
        fields += [os.fsencode(own_dep if own_md else ""), os.fsencode(keep_dir if keep else "")]
        fields.append(dryrun)
        client.ask(directory, call[0], call[1], [COMPILE, b"store", *fields, stdout, stderr])
        return status if status >= 0 else 128 - status
    finally:
        procs.remove_tree(private)


# The server's side ---------------------------------------------------------------


def plan(cache: Cache, job: Job) -> list[bytes]:
    """The server's answer to a plan after a direct miss: ``compile`` for a first compile,
    ``preprocess`` when a result may be stored under the preprocessed key."""
    from kernelcache.nvcc import key as nvcc_key
    from kernelcache.nvcc import preprocess

    if not nvcc_key.flag(job.env, "KERNELCACHE_NVCC_PREPROCESSED", True):
        return _compile_plan(job, keep=False)  # stored under the direct key and its inputs
    if cache.get(nvcc_key.seen_key(job.command)) is not None:
        # The preprocessing runs in the client, beside the build's other jobs (this server
        # answers one request at a time); the lookup comes back as its own step.
        basedir = os.fsencode(job.basedir or "")
        dry = map(os.fsencode, preprocess.dryrun_args(job.inv))
        return [b"preprocess", os.fsencode(job.nvcc), basedir, *dry]
    return _compile_plan(job)


def _compile_plan(job: Job, keep: bool = True) -> list[bytes]:
    """``compile``, nvcc, whether to add the launcher's own ``-MD``, whether to keep the
    preprocessed files (which give the preprocessed key), then nvcc's arguments."""
    own_md = b"1" if job.inv.depmode is None else b"0"
    flags = [own_md, b"1" if keep else b"0"]
    return [b"compile", os.fsencode(job.nvcc), *flags, *map(os.fsencode, job.args)]


def lookup(settings: Settings, cache: Cache, job: Job, fields: list[bytes]) -> list[bytes]:
    """The server's answer to a client's preprocessing: the result stored under its
    digests (outputs written here, as for a direct hit), else the plan to compile."""
    from kernelcache.nvcc import key as nvcc_key
    from kernelcache.nvcc import miss

    started, digests = int(fields[0]), [d.decode() for d in fields[1].split(b",") if d]
    if digests:
        pre = nvcc_key.preprocessed_key(job.command, digests)
        restored = miss.preprocessed_lookup(cache, job, pre, started)
        if restored is not None:
            result, outcome = restored
            outcome.record(settings)
            from kernelcache.nvcc.outputs import messages

            return [b"hit", b"0", *messages(result, job.basedir)]
    # A miss: compiled with --keep, as a first compile is; its kept files give the same key.
    return _compile_plan(job)


def store(settings: Settings, cache: Cache, job: Job, fields: list[bytes]) -> list[bytes]:
    """Cache a client's compile (:func:`kernelcache.nvcc.miss.finish`) and count it."""
    from kernelcache.nvcc import miss, preprocess
    from kernelcache.nvcc.job import Outcome

    started, elapsed, status = int(fields[0]), float(fields[1]), int(fields[2])
    own_dep, keep_dir = os.fsdecode(fields[3]), os.fsdecode(fields[4])
    if status != 0:
        outcome = Outcome("failed")
    else:
        kept = None  # not kept (KERNELCACHE_NVCC_PREPROCESSED=0): no preprocessed key
        if keep_dir:
            kept = preprocess.kept_in(preprocess.read_dryrun(fields[5], job.env), keep_dir)
        outcome = miss.finish(
            cache, job, None, kept, (fields[6], fields[7], elapsed), own_dep, started
        )
    outcome.record(settings)
    return [b"stored", outcome.event.encode()]


def main(argv: list[str]) -> None:
    """Exit with nvcc's status when :func:`run` did the call; return otherwise."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    status = run(argv)
    if status is not None:
        os._exit(status)  # everything was written unbuffered; no clean-up to wait for
