"""The lease's arbiters: a :class:`~tidal.distributed.lease_core.LeaseTable` served to other
processes, over TCP (:class:`LeaseServer`, JSON lines, no Ray needed) or as a Ray actor
(:func:`start_lease_actor`), and the matching client transports that
:class:`~tidal.distributed.lease.GPULease` picks from its ``arbiter`` argument.

Blocking waits are served by the arbiter (a wait returns on grant or after at most
``ttl_s / 2``), so a hand-over costs one message round trip, not a polling interval. The TCP
server has no authentication: bind it to loopback (the default) or a trusted network only.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time

from tidal.distributed.lease_core import LeaseError, LeaseTable, _dispatch, _reply, _unchanged

__all__ = ["LeaseServer", "start_lease_actor"]


# ---- transport 1: TCP, JSON lines -------------------------------------------------------------
class _Handler(socketserver.StreamRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.server.connections.add(self.connection)  # type: ignore[attr-defined]

    def finish(self) -> None:
        self.server.connections.discard(self.connection)  # type: ignore[attr-defined]
        super().finish()

    def handle(self) -> None:
        server: LeaseServer = self.server.lease_server  # type: ignore[attr-defined]
        limit = server.max_request_bytes
        while True:
            # Bounded: a line longer than the limit is never held whole in memory.
            line = self.rfile.readline(limit + 1)
            if not line:
                return
            too_long = len(line) > limit
            if too_long:
                out = {
                    "ok": False,
                    "error": "LeaseUsageError",
                    "message": f"bad request: longer than {limit} bytes; the connection is closed",
                }
            else:
                try:
                    msg = json.loads(line)
                    op, kwargs = msg["op"], msg.get("kwargs", {})
                except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                    # RecursionError: JSON nested deeper than the parser's recursion limit.
                    out = {"ok": False, "error": "LeaseUsageError", "message": f"bad request: {type(e).__name__}: {e}"}
                else:
                    try:
                        out = server._serve(op, kwargs)
                    except Exception as e:  # noqa: BLE001 (answered, never a silent dead handler)
                        out = {"ok": False, "error": "LeaseError", "message": f"server error: {type(e).__name__}: {e}"}
            try:
                self.wfile.write(json.dumps(out).encode() + b"\n")
                self.wfile.flush()
            except OSError:  # the client went away (killed, or closed mid-wait)
                return
            if too_long:
                return  # the rest of that line would be read as requests: drop the connection


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class LeaseServer:
    """The arbiter over TCP (one thread per client connection), run in any process.

    ``LeaseServer(ttl_s=10).start()`` serves on ``address`` (``"host:port"``; port 0 picks a
    free one) from a daemon thread until :meth:`close`.

    A request is one JSON line of at most ``max_request_bytes`` (real ones are a few hundred
    bytes): a longer one is answered with an error and its connection closed, so a client
    cannot make the server hold more than that per connection. A malformed request (bad JSON,
    JSON nested too deep to parse, wrong fields) is answered with ``LeaseUsageError`` and the
    connection stays usable.
    """

    max_request_bytes = 64 << 10

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 10.0) -> None:
        self.table = LeaseTable(ttl_s=ttl_s)
        self._cond = threading.Condition()
        self._server = _TCPServer((host, port), _Handler)
        self._server.lease_server = self  # type: ignore[attr-defined]
        self._server.connections = set()  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> "LeaseServer":
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="tidal-lease-server", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and drop every client connection (their next call raises LeaseError).
        Idempotent; returns at once for a server that was never started."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            # shutdown() waits for serve_forever() to notice: never call it if that never ran.
            self._server.shutdown()
        self._server.server_close()
        for conn in list(self._server.connections):  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> "LeaseServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self, op: str, kwargs: dict) -> dict:
        with self._cond:
            if op != "wait":
                out = _reply(lambda: _dispatch(self.table, op, kwargs))
                self._cond.notify_all()
                return out
            return _reply(lambda: self._wait(**kwargs))

    def _wait(self, *, ticket: int, timeout_s: float, seen_bytes: int | None = None) -> dict:
        # Called with the condition held. Capped at ttl/2 so a blocked waiter never outlives
        # its own keep-alive; every wake sweeps, which is what expires a silent holder.
        end = time.monotonic() + min(float(timeout_s), self.table.ttl_s / 2)
        st = self.table.touch(ticket=ticket)
        while _unchanged(st, seen_bytes) and (left := end - time.monotonic()) > 0:
            nd = self.table.next_deadline()
            self._cond.wait(left if nd is None else max(0.0, min(left, nd - time.monotonic()) + 1e-3))
            self.table.sweep()
            st = self.table.status(ticket=ticket)
        self._cond.notify_all()  # a sweep may have granted someone else
        return st


class _TCPBackend:
    def __init__(self, address: str, *, connect_timeout_s: float) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"lease address must be 'host:port', got {address!r}")
        self.address = address
        self._host_port = (host, int(port))
        self._connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._file = None
        self._connect()
        self._lock = threading.Lock()

    def _connect(self) -> None:
        try:
            sock = socket.create_connection(self._host_port, timeout=self._connect_timeout_s)
        except OSError as e:
            raise LeaseError(
                f"cannot reach the lease server at {self.address}: {e}. Start one with "
                f"LeaseServer(...).start() and pass its address"
            ) from e
        sock.settimeout(None)
        self._sock, self._file = sock, sock.makefile("rwb")

    def call(self, op: str, **kwargs) -> dict:
        with self._lock:  # one request in flight per connection (heartbeat thread vs caller)
            try:
                if self._file is None:
                    self._connect()
                self._file.write(json.dumps({"op": op, "kwargs": kwargs}).encode() + b"\n")
                self._file.flush()
                line = self._file.readline()
            except BaseException as e:
                # Interrupted mid-call (Ctrl-C in a long-poll wait) or failed: the reply may
                # still arrive on this connection and answer the next call. Drop the
                # connection; the next call opens a fresh one.
                self._drop()
                if isinstance(e, OSError):
                    raise LeaseError(f"lease server at {self.address} failed during {op!r}: {e}") from e
                raise
        if not line:
            self._drop()
            raise LeaseError(f"lease server at {self.address} closed the connection during {op!r}")
        return json.loads(line)

    def _drop(self) -> None:
        file, sock, self._file, self._sock = self._file, self._sock, None, None
        with contextlib.suppress(OSError, AttributeError):
            file.close()
            sock.close()

    def close(self) -> None:
        self._drop()


# ---- transport 2: a Ray actor ---------------------------------------------------------------
_ACTOR_CLASS = None


def _lease_actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import asyncio  # noqa: PLC0415

        import ray  # noqa: PLC0415  (optional dependency: tidal[ray])

        class GPULeaseActor:
            """The arbiter as an async Ray actor: one event loop serialises the table."""

            def __init__(self, ttl_s: float) -> None:
                self.table = LeaseTable(ttl_s=ttl_s)
                self._cond: asyncio.Condition | None = None

            async def call(self, op: str, kwargs: dict) -> dict:
                if self._cond is None:
                    self._cond = asyncio.Condition()
                async with self._cond:
                    if op == "wait":
                        out = await self._wait(**kwargs)
                    else:
                        out = _reply(lambda: _dispatch(self.table, op, kwargs))
                    self._cond.notify_all()
                    return out

            async def _wait(self, *, ticket: int, timeout_s: float, seen_bytes: int | None = None) -> dict:
                end = time.monotonic() + min(float(timeout_s), self.table.ttl_s / 2)
                st = _reply(lambda: self.table.touch(ticket=ticket))
                while _unchanged(st, seen_bytes) and (left := end - time.monotonic()) > 0:
                    nd = self.table.next_deadline()
                    wait_s = left if nd is None else max(0.0, min(left, nd - time.monotonic()) + 1e-3)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), wait_s)
                    st = _reply(lambda: (self.table.sweep(), self.table.status(ticket=ticket))[1])
                return st

        _ACTOR_CLASS = ray.remote(num_cpus=0, max_concurrency=1000)(GPULeaseActor)
    return _ACTOR_CLASS


def start_lease_actor(name: str, *, ttl_s: float = 10.0, namespace: str | None = None, **options):
    """Start, or get if it lives, the arbiter of one GPU as a named Ray actor (it lives as long
    as the job that started it). Every process sharing the GPU passes the same ``name`` (e.g.
    ``Placement.lease_name(role, index)``) and wraps the handle in :class:`GPULease`. Extra
    ``options`` go to ``.options()`` (e.g. a scheduling strategy to keep it on the GPU's node)."""
    cls = _lease_actor_class()
    return cls.options(name=name, namespace=namespace, get_if_exists=True, **options).remote(ttl_s)


class _RayBackend:
    def __init__(self, actor) -> None:
        self.actor = actor
        self.address = f"ray actor {actor}"

    def call(self, op: str, **kwargs) -> dict:
        import ray  # noqa: PLC0415

        try:
            return ray.get(self.actor.call.remote(op, kwargs))
        except ray.exceptions.RayActorError as e:
            raise LeaseError(f"the lease actor died during {op!r}: {e}") from e

    def close(self) -> None:
        pass
