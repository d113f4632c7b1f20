"""Multi-process ``jaxcert certify``: joining, and the meetings of the processes.

Several processes (the hosts of a TPU pod, the nodes of a GPU cluster, or CPU processes on
one machine) each certify their share of the prompts on their own devices and meet only to
merge the results, through the coordination service of :func:`jax.distributed.initialize`
(no cross-host device collectives and no shared file system are needed).

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

import dataclasses
import errno
import os
import time

__all__ = [
    "Distributed",
    "ProcessFailed",
    "announce_result",
    "broadcast_bytes",
    "exchange_bytes",
    "fail_broadcast",
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
    """

    process_index: int = 0
    process_count: int = 1

    @property
    def is_main(self) -> bool:
        """True on process 0, which merges the parts and writes the summaries."""
        return self.process_index == 0


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
      A :class:`Distributed` (``process_index``, ``process_count``).

    Raises:
      ValueError: an incomplete or inconsistent set of values, a process that did not join
        within ``timeout_s``, or a failed connection.
    """
    import jax

    coordinator = coordinator or os.environ.get(_ENV["coordinator"]) or None
    if num_processes is None:
        num_processes = _env_int(_ENV["num_processes"])
    if process_id is None:
        process_id = _env_int(_ENV["process_id"])
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given) and not auto:
        return Distributed()
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None:
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"--process-id must be in [0, {num_processes}) with --num-processes "
                f"{num_processes}, got {process_id}"
            )
    if num_processes == 1 and process_id in (None, 0) and not auto:
        return Distributed()  # one process: nothing to coordinate
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
    try:  # gloo is the default in recent JAX; older versions had no CPU collectives
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # an option this JAX does not know
        pass
    if coordinator is not None and num_processes is not None and process_id is not None:
        # JAX aborts the process (absl fatal error) when a peer does not connect in time: meet
        # first, where a missing peer is an error this process can report.
        _rendezvous(coordinator, num_processes, process_id, timeout_s)
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
    return Distributed(jax.process_index(), jax.process_count())


_JOIN = b"jaxcert-join"


def _rendezvous(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Every process meets on the coordinator's ``HOST:PORT`` before JAX's service starts there.

    Process 0 listens on ``PORT``; each other process connects (retrying until
    ``timeout_s``) and sends its index; once all have come, process 0 answers each, the
    others close their connection first, and process 0 closes its socket, so that JAX's
    coordination service can bind the same port. Plain TCP, one line each way.

    Raises:
      ValueError: a process did not come within ``timeout_s`` (on process 0: which ones;
        elsewhere: process 0 could not be reached), or a process index or count that
        another process does not share.
    """
    import socket

    host, port = coordinator.rsplit(":", 1)
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    if process_id != 0:
        while True:
            try:
                conn = socket.create_connection((host, int(port)), timeout=5)
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
            conn.sendall(b"%s %d %d\n" % (_JOIN, process_id, num_processes))
            try:
                answer = conn.makefile("rb").readline().strip()
            except OSError:
                answer = b""
        if answer != b"go":
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
        return
    try:
        try:
            server = socket.create_server(
                ("", int(port)), family=socket.AF_INET6, dualstack_ipv6=True
            )
        except (OSError, ValueError) as err:
            if getattr(err, "errno", None) == errno.EADDRINUSE:
                raise
            server = socket.create_server(("", int(port)))
    except OSError as err:
        raise ValueError(
            f"--coordinator {coordinator}: process 0 cannot listen on port {port} ({err}); "
            "is another run using it? Choose another port"
        ) from None
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
            conn.settimeout(5)
            try:
                words = conn.makefile("rb").readline().split()
            except OSError:
                conn.close()
                continue
            if len(words) != 3 or words[0] != _JOIN:
                conn.close()  # not one of ours
                continue
            index, count = int(words[1]), int(words[2])
            if count != num_processes or index in joined or not 0 < index < num_processes:
                conn.sendall(b"refused: process %d of %d, process 0 expects %d processes\n"
                             % (index, count, num_processes))  # fmt: skip
                conn.close()
                continue
            joined[index] = conn
        for conn in joined.values():
            conn.sendall(b"go\n")
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


def _client():
    from jax._src import distributed  # the handle jax.experimental.multihost_utils uses

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised")
    return client


_FAILED = b"\x00jaxcert-failed\x00"


class ProcessFailed(RuntimeError):
    """Another process of a multi-process run failed or did not answer in time."""


def exchange_bytes(
    name: str,
    payload: bytes | None,
    dist: Distributed,
    *,
    error: str | None = None,
    timeout_s: float = 24 * 3600,
) -> list[bytes | ProcessFailed] | None:
    """Sends this process's ``payload`` to process 0; process 0 gets every process's, in order.

    Goes through the key-value store of JAX's coordination service, so the processes need
    no shared file system. A process that failed passes ``error`` instead of a payload.
    Process 0 receives each process's outcome, a failure included, so that it can keep
    what the others sent; the other processes then wait for process 0's
    :func:`announce_result`, so every process ends with the run's outcome.

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
      ProcessFailed: elsewhere than on process 0, when process 0 announces a failure or
        does not answer in time.
    """
    if dist.process_count == 1:
        return None if error is not None else [payload or b""]
    client = _client()
    value = _FAILED + error.encode() if error is not None else (payload or b"")
    if not dist.is_main:
        client.key_value_set_bytes(f"jaxcert/{name}/{dist.process_index}", value)
        if error is None:
            _check(_get(client, f"jaxcert/{name}/result", timeout_s, 0, dist), 0, dist)
        return None
    if error is not None:
        return None
    parts: list[bytes | ProcessFailed] = [value]
    for i in range(1, dist.process_count):
        try:
            parts.append(_check(_get(client, f"jaxcert/{name}/{i}", timeout_s, i, dist), i, dist))
        except ProcessFailed as failed:
            parts.append(failed)
    return parts


def announce_result(name: str, dist: Distributed, error: str | None = None) -> None:
    """Process 0 tells the others how the run ended (they wait in :func:`exchange_bytes`)."""
    if dist.process_count > 1 and dist.is_main:
        value = b"ok" if error is None else _FAILED + error.encode()
        _client().key_value_set_bytes(f"jaxcert/{name}/result", value)


def broadcast_bytes(
    name: str, payload: bytes | None, dist: Distributed, *, timeout_s: float = 24 * 3600
) -> bytes:
    """Process 0's ``payload`` on every process (process 0 passes it, the others ``None``).

    Raises:
      ProcessFailed: process 0 sent a failure (:func:`fail_broadcast`) or nothing in time.
    """
    if dist.process_count == 1:
        return payload or b""
    client = _client()
    if dist.is_main:
        client.key_value_set_bytes(f"jaxcert/{name}/broadcast", payload or b"")
        return payload or b""
    return _check(_get(client, f"jaxcert/{name}/broadcast", timeout_s, 0, dist), 0, dist)


def fail_broadcast(name: str, dist: Distributed, error: str) -> None:
    """Process 0 failed before :func:`broadcast_bytes`: the others raise instead of waiting."""
    if dist.process_count > 1 and dist.is_main:
        _client().key_value_set_bytes(f"jaxcert/{name}/broadcast", _FAILED + error.encode())


def _get(client, key: str, timeout_s: float, i: int, dist: Distributed) -> bytes:
    t0 = time.monotonic()
    try:
        return client.blocking_key_value_get_bytes(key, int(timeout_s * 1e3))
    except Exception as err:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED, ...)
        raise ProcessFailed(
            f"process {i} of {dist.process_count} sent no result within "
            f"{time.monotonic() - t0:.0f} s: {err}"
        ) from None


def _check(value: bytes, i: int, dist: Distributed) -> bytes:
    if value.startswith(_FAILED):
        reason = value[len(_FAILED) :].decode()
        raise ProcessFailed(f"process {i} of {dist.process_count} failed: {reason}")
    return value
