"""Multi-process ``jaxcert certify``: joining, the meetings of the processes, merging the parts.

Several processes (the hosts of a TPU pod, the nodes of a GPU cluster, or CPU processes on
one machine) each certify their share of the prompts on their own devices and meet only to
merge the results (no cross-host device collectives and no shared file system are needed).
They meet through a small key-value store that process 0 serves over TCP (:class:`Peers`
holds this process's side of the meetings): with ``--coordinator`` its address travels
in the rendezvous on the coordinator's port; under cluster detection (``--distributed``)
process 0 sends it once, right after :func:`jax.distributed.initialize`, with
:func:`jax.experimental.multihost_utils.broadcast_one_to_all`.

Launching ``N`` processes (each runs the same command):

* **TPU pod** (every host of the slice): ``jaxcert certify --distributed ...``; JAX detects
  the coordinator, the process count and this host's index itself.
* **SLURM** (one task per node, ``srun --ntasks-per-node=1 jaxcert certify --distributed
  ...``): detected from ``SLURM_*`` variables; Open MPI (``mpirun``) likewise.
* **Anything else** (plain ssh, containers, CPU processes on localhost): pass
  ``--coordinator HOST:PORT --num-processes N --process-id I`` (process 0 listens on
  ``PORT`` of ``HOST``), or set ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID``. On CPU the collectives go through gloo.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import shutil
import socket
import threading
import time

from jaxcert.base.tables import counted

__all__ = [
    "Distributed",
    "Peers",
    "ProcessFailed",
    "initialize_distributed",
]

_ENV = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


@dataclasses.dataclass(frozen=True)
class Distributed:
    """Where this process stands in a multi-process run.

    Attributes:
      process_index: this process (``0 <= process_index < process_count``).
      process_count: number of processes (1: a plain single-process run).
      store: the run's key-value store (process 0 serves it; ``None`` with one process).
    """

    process_index: int = 0
    process_count: int = 1
    store: _Store | _Remote | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """True on process 0, which merges the parts and writes the summaries."""
        return self.process_index == 0


class ProcessFailed(RuntimeError):
    """Another process of a multi-process run failed or did not answer in time."""


# ---------------------------------------------------------------------------------------------
# Joining


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {value!r}") from None


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    timeout_s: int = 300,
) -> Distributed:
    """Calls :func:`jax.distributed.initialize` when the arguments or environment ask for it.

    Must run before anything else touches JAX's devices. Arguments left ``None`` are read
    from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.
    Nothing is initialised (a single-process run) when none of the three is set and
    ``auto`` is false; with ``auto`` JAX detects the cluster (TPU pods, SLURM, Open MPI).

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes: number of processes.
      process_id: this process's index.
      auto: initialise even with nothing given (cluster auto-detection).
      timeout_s: how long to wait for every process to join (``--join-timeout``). With an
        explicit coordinator the processes first meet on its address (:func:`_rendezvous`),
        so a process that never comes is a ``ValueError`` after ``timeout_s``; under
        cluster auto-detection JAX's own wait applies (JAX aborts the process then).

    Returns:
      A :class:`Distributed` (``process_index``, ``process_count`` and the run's store).

    Raises:
      ValueError: an incomplete or inconsistent set of values, a process that did not join
        within ``timeout_s``, or a failed connection.
    """
    given = _settings(coordinator, num_processes, process_id, auto)
    if given is None:
        return Distributed()
    _use_gloo()
    coordinator, num_processes, process_id = given
    store: _Store | _Remote | None = None
    if coordinator is not None and num_processes is not None and process_id is not None:
        # JAX aborts the process (absl fatal error) when a peer does not connect in time: meet
        # first, where a missing peer is an error this process can report.
        store = _rendezvous(coordinator, num_processes, process_id, timeout_s)
    try:
        index, count = _initialize_jax(coordinator, num_processes, process_id, timeout_s)
        if store is None and count > 1:
            store = _store_by_broadcast(index)
    except BaseException:
        if isinstance(store, _Store):
            store.close()
        raise
    return Distributed(index, count, store)


def _settings(
    coordinator: str | None, num_processes: int | None, process_id: int | None, auto: bool
) -> tuple[str | None, int | None, int | None] | None:
    """The coordinator, process count and index from the arguments and the environment,
    checked; ``None`` for a single-process run (nothing to initialise)."""
    coordinator = coordinator or os.environ.get(_ENV["coordinator"]) or None
    if num_processes is None:
        num_processes = _env_int(_ENV["num_processes"])
    if process_id is None:
        process_id = _env_int(_ENV["process_id"])
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given) and not auto:
        return None
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None:
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"--process-id must be in [0, {num_processes}) with --num-processes "
                f"{num_processes}, got {process_id}"
            )
    if num_processes == 1 and process_id in (None, 0) and not auto:
        return None  # one process: nothing to coordinate
    if not auto and None in given:
        missing = [
            f"--{k.replace('_', '-')} (or ${_ENV[k]})"
            for k, v in zip(_ENV, given, strict=True)
            if v is None
        ]
        raise ValueError(
            f"a multi-process run needs {', '.join(missing)} too; or pass --distributed to "
            "let JAX detect the cluster (TPU pods, SLURM, Open MPI)"
        )
    if coordinator is not None and (":" not in coordinator or not coordinator.rsplit(":", 1)[1]):
        raise ValueError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    return given


def _use_gloo() -> None:
    import jax

    try:  # gloo is the default in recent JAX; older versions had no CPU collectives
        # jax.config's options are attributes it adds at run time, which its typing lacks
        current = jax.config.jax_cpu_collectives_implementation  # type: ignore[attr-defined]
        if current in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # an option this JAX does not know
        pass


def _initialize_jax(coordinator, num_processes, process_id, timeout_s) -> tuple[int, int]:
    """:func:`jax.distributed.initialize`; returns ``(process_index, process_count)``."""
    import jax

    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
        )
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"jax.distributed.initialize failed (coordinator {coordinator}, "
            f"{num_processes} processes, process {process_id}): {err}"
        ) from err
    return jax.process_index(), jax.process_count()


_JOIN = b"jaxcert-join"


def _rendezvous(coordinator: str, num_processes: int, process_id: int, timeout_s: float):
    """Every process meets on the coordinator's ``HOST:PORT`` before JAX's service starts there.

    Process 0 opens the run's store (:class:`_Store`, on a port of its own) and listens on
    ``PORT``; each other process connects (retrying until ``timeout_s``) and sends its
    index; once all have come, process 0 answers each with the store's port, the others
    close their connection first, and process 0 closes its socket, so that JAX's
    coordination service can bind the same port. Plain TCP, one line each way.

    Returns:
      The run's store: process 0's :class:`_Store`, elsewhere a :class:`_Remote` of it.

    Raises:
      ValueError: a process did not come within ``timeout_s`` (on process 0: which ones;
        elsewhere: process 0 could not be reached), or a process index or count that
        another process does not share.
    """
    host, port_text = coordinator.rsplit(":", 1)
    host, port = host.strip("[]"), int(port_text)
    deadline = time.monotonic() + timeout_s
    if process_id != 0:
        hello = b"%d %d" % (process_id, num_processes)
        answer = _join(coordinator, (host, port), hello, deadline, timeout_s)
        words = answer.split()
        if len(words) != 2 or words[0] != b"go" or not words[1].isdigit():
            said = answer.decode() if answer.startswith(b"refused") else None
            raise ValueError(
                f"process 0 at {coordinator} did not let process {process_id} join within "
                f"{timeout_s:g} s (--join-timeout): "
                + (
                    said
                    or "no answer from a jaxcert process 0 there (is another run, or "
                    "another program, using that address?)"
                )
            )
        return _Remote(host, int(words[1]))
    store = _Store()
    try:
        server = _listen(coordinator, port)
        go = b"go %d\n" % store.port
        _welcome(server, coordinator, num_processes, (deadline, timeout_s), go)
    except BaseException:
        store.close()
        raise
    return store


def _join(coordinator: str, address, words: bytes, deadline: float, timeout_s: float) -> bytes:
    """A process other than 0: connects to process 0 (retrying until ``deadline``), says who
    it is, and returns process 0's answer (empty when none came)."""
    while True:
        try:
            conn = socket.create_connection(address, timeout=5)
            break
        except OSError as err:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"process 0 could not be reached at {coordinator} within {timeout_s:g} s "
                    f"(--join-timeout): {err}"
                ) from None
            time.sleep(0.2)
    with conn:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        conn.sendall(b"%s %s\n" % (_JOIN, words))
        try:
            return conn.makefile("rb").readline().strip()
        except OSError:
            return b""


def _listen(coordinator: str, port: int) -> socket.socket:
    """Process 0's socket on the coordinator's port (IPv6 and IPv4 where it can)."""
    try:
        return _server(port)
    except OSError as err:
        raise ValueError(
            f"--coordinator {coordinator}: process 0 cannot listen on port {port} ({err}); "
            "is another run using it? Choose another port"
        ) from None


def _server(port: int) -> socket.socket:
    try:
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError) as err:
        if getattr(err, "errno", None) == errno.EADDRINUSE:
            raise
        return socket.create_server(("", port))


def _welcome(server, coordinator: str, num_processes: int, until, go: bytes) -> None:
    """Process 0: accepts every other process until ``until = (deadline, timeout_s)``, then
    sends each ``go``, waits for them to close first, and closes its socket (the port is
    free for JAX's service)."""
    deadline, timeout_s = until
    joined: dict[int, socket.socket] = {}
    try:
        while len(joined) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(joined))
                raise ValueError(
                    f"processes {missing} of {num_processes} did not join within {timeout_s:g} s "
                    f"(--join-timeout; process 0 listens on {coordinator})"
                )
            server.settimeout(min(left, 1.0))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            _admit(conn, num_processes, joined)
        for conn in joined.values():
            conn.sendall(go)
        for conn in joined.values():  # they close first: the port is free for JAX's service
            conn.settimeout(10)
            try:
                conn.recv(1)
            except OSError:
                pass
    finally:
        for conn in joined.values():
            conn.close()
        server.close()


def _admit(conn: socket.socket, num_processes: int, joined: dict) -> None:
    """Reads a newcomer's line: one of this run's processes joins ``joined``; anything else
    is refused (with a reason when it is a jaxcert process of another shape) and closed."""
    conn.settimeout(5)
    try:
        words = conn.makefile("rb").readline().split()
    except OSError:
        conn.close()
        return
    if len(words) != 3 or words[0] != _JOIN:
        conn.close()  # not one of ours
        return
    index, count = int(words[1]), int(words[2])
    if count != num_processes or index in joined or not 0 < index < num_processes:
        conn.sendall(b"refused: process %d of %d, process 0 expects %d processes\n"
                     % (index, count, num_processes))  # fmt: skip
        conn.close()
        return
    joined[index] = conn


def _store_by_broadcast(index: int):
    """Under cluster detection (no rendezvous): process 0 opens the store and sends its
    address to the others with one broadcast, while every process is there."""
    import numpy as np
    from jax.experimental import multihost_utils

    store = _Store() if index == 0 else None
    text = f"{socket.getfqdn()} {store.port}".encode() if store is not None else b""
    buf = np.zeros(512, np.uint8)
    buf[: len(text)] = np.frombuffer(text, np.uint8)
    got = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0").split()
    return store if store is not None else _Remote(got[0].decode(), int(got[1]))


# ---------------------------------------------------------------------------------------------
# The run's key-value store: process 0 holds the values, the others reach them over TCP.


def _send_message(conn: socket.socket, header: dict, payload: bytes = b"") -> None:
    conn.sendall(json.dumps(header | {"size": len(payload)}).encode() + b"\n" + payload)


def _read_message(stream) -> tuple[dict, bytes]:
    line = stream.readline()
    if not line:
        raise ConnectionError("the connection closed without an answer")
    header = json.loads(line)
    payload = stream.read(header["size"])
    if len(payload) != header["size"]:
        raise ConnectionError("the connection closed in the middle of a message")
    return header, payload


class _Store:
    """Process 0's key-value store, served on a port of its own to the other processes.

    A request is one JSON line (``set``: a key to store the payload under; ``get``: a key to
    wait for, at most ``timeout`` seconds) and the payload; the answer is a JSON line and
    the value got (``{"timeout": true}`` when none came in time).
    """

    def __init__(self) -> None:
        self._server = _server(0)
        self.port = self._server.getsockname()[1]
        self._values: dict[str, bytes] = {}
        self._waiting: collections.Counter = collections.Counter()  # key -> remote waiters
        self._cond = threading.Condition()
        threading.Thread(target=self._serve, name="jaxcert-store", daemon=True).start()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._values[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._values, timeout_s):
                raise TimeoutError(f"no value for {key} within {timeout_s:g} s")
            return self._values[key]

    def drain(self, key: str, timeout_s: float = 60.0) -> None:
        """Waits (at most ``timeout_s``) until every process waiting for ``key`` has it."""
        with self._cond:
            self._cond.wait_for(lambda: not self._waiting[key], timeout_s)

    def close(self) -> None:
        self._server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                header, payload = _read_message(conn.makefile("rb"))
            except (OSError, ValueError, KeyError):
                return
            wanted = header.get("get")
            with self._cond:
                if wanted is not None:  # counted before the value is set: drain waits for it
                    self._waiting[wanted] += 1
                if header.get("set") is not None:
                    self._values[header["set"]] = payload
                    self._cond.notify_all()
            if wanted is None:
                return self._reply(conn, {"ok": True})
            try:
                self._reply(conn, {"ok": True}, self.get(wanted, float(header["timeout"])))
            except TimeoutError:
                self._reply(conn, {"timeout": True})
            finally:
                with self._cond:
                    self._waiting[wanted] -= 1
                    self._cond.notify_all()

    @staticmethod
    def _reply(conn, header: dict, payload: bytes = b"") -> None:
        try:
            _send_message(conn, header, payload)
        except OSError:
            pass


class _Remote:
    """The store of process 0, from another process (one connection a request)."""

    def __init__(self, host: str, port: int):
        self.address = (host, port)

    def set(self, key: str, value: bytes) -> None:
        self._request({"set": key}, value, 60.0)

    def get(self, key: str, timeout_s: float) -> bytes:
        return self._request({"get": key, "timeout": timeout_s}, b"", timeout_s + 60)

    def set_then_get(self, key: str, value: bytes, wanted: str, timeout_s: float) -> bytes:
        """Stores ``value`` under ``key``, then waits for ``wanted``, in one request: process 0
        sees this process waiting as soon as it has the value."""
        header = {"set": key, "get": wanted, "timeout": timeout_s}
        return self._request(header, value, timeout_s + 60)

    def _request(self, header: dict, payload: bytes, timeout_s: float) -> bytes:
        with socket.create_connection(self.address, timeout=60) as conn:
            conn.settimeout(timeout_s)
            _send_message(conn, header, payload)
            answer, value = _read_message(conn.makefile("rb"))
        if answer.get("timeout"):
            raise TimeoutError(f"no value for {header.get('get')} within {timeout_s:g} s")
        return value


def _store(dist: Distributed):
    if dist.store is None:
        raise RuntimeError("this multi-process run has no store (initialize_distributed)")
    return dist.store


# ---------------------------------------------------------------------------------------------
# The meetings


_FAILED = b"\x00jaxcert-failed\x00"


def _exchange_bytes(
    name: str,
    payload: bytes | None,
    dist: Distributed,
    *,
    error: str | None = None,
    timeout_s: float = 24 * 3600,
) -> list[bytes | ProcessFailed] | None:
    """Sends this process's ``payload`` to process 0; process 0 gets every process's, in order.

    Goes through the run's store (process 0's, over TCP), so the processes need no shared
    file system. A process that failed passes ``error`` instead of a payload. Process 0
    receives each process's outcome, a failure included, so that it can keep what the
    others sent; the other processes then wait for process 0's :func:`_announce_result`,
    so every process ends with the run's outcome.

    Args:
      name: a key unique to this exchange (the same on every process).
      payload: this process's bytes (ignored when ``error`` is set).
      dist: this process's :class:`Distributed`.
      error: this process's failure, reported to process 0.
      timeout_s: how long a process waits for each answer it needs.

    Returns:
      On process 0 the ``process_count`` outcomes in process order: the bytes, or a
      :class:`ProcessFailed` for a process that failed or did not answer in time (its own,
      first, is ``payload``); ``None`` elsewhere.

    Raises:
      ProcessFailed: elsewhere than on process 0, when process 0 announces a failure, does
        not answer in time or cannot be reached.
    """
    if dist.process_count == 1:
        return None if error is not None else [payload or b""]
    store = _store(dist)
    value = _FAILED + error.encode() if error is not None else (payload or b"")
    if not dist.is_main:
        key = f"jaxcert/{name}/{dist.process_index}"
        if error is not None:
            _ask(lambda: store.set(key, value), 0, dist, 0.0)
        else:
            wait = lambda: store.set_then_get(key, value, f"jaxcert/{name}/result", timeout_s)  # noqa: E731
            _check(_ask(wait, 0, dist, timeout_s), 0, dist)
        return None
    if error is not None:
        return None
    parts: list[bytes | ProcessFailed] = [value]
    for i in range(1, dist.process_count):
        try:
            got = _ask(lambda i=i: store.get(f"jaxcert/{name}/{i}", timeout_s), i, dist, timeout_s)
            parts.append(_check(got, i, dist))
        except ProcessFailed as failed:
            parts.append(failed)
    return parts


def _announce_result(name: str, dist: Distributed, error: str | None = None) -> None:
    """Process 0 tells the others how the run ended (they wait in :func:`_exchange_bytes`),
    and waits (a minute at most) until each one waiting has been told."""
    if dist.process_count > 1 and dist.is_main:
        key = f"jaxcert/{name}/result"
        store = _store(dist)
        store.set(key, b"ok" if error is None else _FAILED + error.encode())
        store.drain(key)


def _broadcast_bytes(
    name: str, payload: bytes | None, dist: Distributed, *, timeout_s: float = 24 * 3600
) -> bytes:
    """Process 0's ``payload`` on every process (process 0 passes it, the others ``None``).

    Raises:
      ProcessFailed: process 0 sent a failure (:func:`_fail_broadcast`) or nothing in time.
    """
    if dist.process_count == 1:
        return payload or b""
    store, key = _store(dist), f"jaxcert/{name}/broadcast"
    if dist.is_main:
        store.set(key, payload or b"")
        return payload or b""
    return _check(_ask(lambda: store.get(key, timeout_s), 0, dist, timeout_s), 0, dist)


def _fail_broadcast(name: str, dist: Distributed, error: str) -> None:
    """Process 0 failed before :func:`_broadcast_bytes`: the others raise instead of waiting."""
    if dist.process_count > 1 and dist.is_main:
        _store(dist).set(f"jaxcert/{name}/broadcast", _FAILED + error.encode())


def _ask(request, i: int, dist: Distributed, timeout_s: float) -> bytes:
    """``request()``; a timeout or a lost connection is :class:`ProcessFailed` naming process
    ``i``, the one whose answer was awaited."""
    t0 = time.monotonic()
    try:
        return request()
    except (OSError, ValueError) as err:  # TimeoutError and ConnectionError are OSErrors
        raise ProcessFailed(
            f"process {i} of {dist.process_count} sent no result within "
            f"{time.monotonic() - t0:.0f} s: {err}"
        ) from None


def _check(value: bytes, i: int, dist: Distributed) -> bytes:
    if value.startswith(_FAILED):
        reason = value[len(_FAILED) :].decode()
        raise ProcessFailed(f"process {i} of {dist.process_count} failed: {reason}")
    return value


# ---------------------------------------------------------------------------------------------
# A certify run's meetings: what is done at the start, the parts at the end


_START = "certify/start"
_EXCHANGE = "certify/positions"


class Peers:
    """This process's side of the meetings of a multi-process certify run (no-ops for one
    process).

    Two meetings: at the start process 0 tells the others what is already done
    (:meth:`start`, through :func:`_broadcast_bytes`), at the end the parts go to process 0
    (:meth:`merge`, through :func:`_exchange_bytes`), which announces the outcome
    (:meth:`done`, :func:`_announce_result`). A process that fails says so at once, exactly
    once (:meth:`fail`), instead of leaving the others waiting.
    """

    def __init__(self, dist: Distributed):
        self.dist = dist
        self.single = dist.process_count == 1
        self.started = self.single or not dist.is_main  # process 0 has to send the start
        self.told = self.single

    def writer(self, out, fingerprint: dict, *, resume: bool, overwrite: bool, **shards):
        """This process's :class:`~jaxcert.pipeline.store.ShardWriter`: process 0 streams
        into ``out`` (resumed or not); another streams into a hidden scratch folder of its
        own, ``out/.process-IIIII``, sent to process 0 at the end (:meth:`merge`). ``shards``
        are ``ShardWriter``'s ``shard_rows`` and ``shard_seconds``."""
        from jaxcert.pipeline.store import ShardWriter

        if self.dist.is_main:
            return ShardWriter(out, fingerprint, resume=resume, overwrite=overwrite, **shards)
        scratch = out / f".process-{self.dist.process_index:05d}"
        return ShardWriter(scratch, fingerprint, overwrite=True, **shards)

    def agree(self, writer) -> tuple[set[int], bool]:
        """``(done, complete)`` on every process: the prompts process 0's ``writer`` holds,
        and whether the run it resumes is complete (``ShardWriter.resumed_complete``)."""
        mine = None
        if self.dist.is_main:
            complete = writer.resumed_complete
            mine = {"done": sorted(writer.done_prompts), "complete": complete}
        start = self.start(mine)
        return set(start.get("done", ())), bool(start.get("complete"))

    def start(self, done: dict | None) -> dict:
        """Process 0 passes ``{"done": [...], "complete": bool}``; every process gets it."""
        if self.single:
            return done or {}
        self.started = True
        payload = None if done is None else json.dumps(done).encode()
        return json.loads(_broadcast_bytes(_START, payload, self.dist))

    def send(self, payload: bytes) -> list | None:
        """Process 0: every process's part or :class:`ProcessFailed`; elsewhere ``None``
        once process 0 has merged them."""
        self.told = not self.dist.is_main  # process 0 still has to announce the outcome
        return _exchange_bytes(_EXCHANGE, payload, self.dist)

    def done(self) -> None:
        if not self.told:
            self.told = True
            _announce_result(_EXCHANGE, self.dist)

    def fail(self, err: BaseException) -> None:
        message = f"{type(err).__name__}: {err}"
        if not self.started:
            self.started = True
            _fail_broadcast(_START, self.dist, message)
        if self.told:
            return
        self.told = True
        if self.dist.is_main:
            _announce_result(_EXCHANGE, self.dist, error=message)
        else:
            try:
                _exchange_bytes(_EXCHANGE, None, self.dist, error=message)
            except ProcessFailed:  # process 0 is gone too: there is no one left to tell
                pass

    def merge(self, writer, fingerprint: dict, info: dict) -> dict | None:
        """The end of a multi-process run: this process's part (the rows ``writer`` wrote
        and its ``info``) goes to process 0, which adds each part that arrived to its own
        ``writer`` (:class:`jaxcert.pipeline.store.ShardWriter`).

        Returns:
          On process 0 the run's :func:`_merged_info`; ``None`` elsewhere, once process 0
          has merged the parts (the scratch folder ``writer.out`` is then removed).

        Raises:
          ProcessFailed: on process 0, a process failed, ran another job or sent nothing;
            the manifest then says ``incomplete`` with every part that did arrive, for
            ``--resume`` to finish.
        """
        outcomes = self.send(_part_payload(writer, fingerprint, info))
        if not self.dist.is_main:  # process 0 has merged the parts: this one is done
            shutil.rmtree(writer.out, ignore_errors=True)
            return None
        assert outcomes is not None  # process 0, which sent no error: every outcome
        infos, failures = [info], []
        for i, outcome in enumerate(outcomes[1:], start=1):
            try:
                part = _read_part(i, outcome, fingerprint)
            except (ProcessFailed, ValueError) as err:  # its rows are not this run's
                failures.append(str(err))
                continue
            if part is not None:
                writer.add_shard(part[0])
                infos.append(part[1])
        info = _merged_info(infos)
        if failures:
            writer.close("incomplete", info=info, error="; ".join(failures))
            raise ProcessFailed(
                f"{'; '.join(failures)}. {counted(len(writer.done_prompts), 'prompt')} "
                f"{'is' if len(writer.done_prompts) == 1 else 'are'} saved in "
                f"{writer.out} (manifest: incomplete); run again with --resume to certify "
                "the rest"
            )
        return info


def _part_payload(writer, fingerprint: dict, info: dict) -> bytes:
    """The rows ``writer`` wrote, as Parquet bytes with the job's fingerprint and ``info``
    in the schema's metadata; empty when this process had nothing left to do."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxcert.pipeline.store import read_positions

    if not writer.rows_written:
        return b""
    table = read_positions(writer.out)
    header = {"fingerprint": fingerprint, "info": info}
    meta = {b"jaxcert": json.dumps(header, default=str).encode()}
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata(meta), sink)
    return sink.getvalue().to_pybytes()


def _read_part(i: int, outcome, fingerprint: dict):
    """Process ``i``'s ``(table, info)``, or ``None`` when it had nothing to send.

    Raises:
      ProcessFailed: the process failed (``outcome`` is its failure).
      ValueError: it ran a different job than process 0 (another fingerprint).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(outcome, ProcessFailed):
        raise outcome
    if not outcome:
        return None
    table = pq.read_table(pa.BufferReader(outcome))
    header = json.loads(table.schema.metadata[b"jaxcert"])
    mine = json.loads(json.dumps(fingerprint, default=str))
    theirs = header["fingerprint"]
    if theirs != mine:
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ValueError(
            f"process {i} ran a different job than process 0 ({', '.join(differ)} differ); "
            "every process must run the same command"
        )
    return table.replace_schema_metadata(None), header["info"]


def _merged_info(infos: list[dict]) -> dict:
    """One ``info`` for the whole run: counts of the first part, sums of the work, the
    slowest process's timings, and every part's own ``info`` under ``processes``."""
    first = infos[0]
    keys = ("prompts_given", "prompts_used", "prompts_skipped_short", "prompts_skipped_long")
    info = {k: first[k] for k in keys}
    for key in ("positions", "prefill_tokens", "prefill_padded_tokens", "decode_slot_steps",
                "decode_active_steps"):  # fmt: skip
        info[key] = sum(i[key] for i in infos)
    for key in ("prefill_s", "decode_s", "compile_s"):
        info[key] = max(i[key] for i in infos)
    info["prompts_resumed"] = first.get("prompts_resumed", 0)
    info["processes"] = infos
    return info
