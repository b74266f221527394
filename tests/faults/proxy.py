"""A TCP proxy on 127.0.0.1 that can cut the network between a client and Redis.

``TCPProxy(target_port)`` forwards connections to ``127.0.0.1:target_port``
on a thread of its own. A cut is one of:

* ``stall()``: nothing passes any more, in either direction, and new
  connections wait in the listen backlog unanswered (a partition: packets
  are held, not refused); ``heal()`` delivers what was held and goes on;
* ``drop()``: every open connection is closed and new ones are closed as soon
  as they are accepted (a proxy or load balancer that resets connections);
  ``heal()`` lets new connections through again.

The thread sleeps in ``select`` and is woken by a pipe on every change of mode;
a change returns once the thread has applied it (after ``drop()``, every
connection is closed). ``close()`` stops the thread and closes every socket.
"""

from __future__ import annotations

import select
import socket
import threading
from types import TracebackType

__all__ = ["TCPProxy"]

_CHUNK = 65536


class TCPProxy:
    def __init__(self, target_port: int, listener: socket.socket | None = None) -> None:
        """``listener``: a socket bound to 127.0.0.1 and not listening yet, to listen on (a held
        port, ``tests/ports.py``: its address refused connections until now); else a new one."""
        self.target = ("127.0.0.1", target_port)
        if listener is None:
            listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        else:
            listener.listen(128)
        self._listener = listener
        self.port: int = self._listener.getsockname()[1]
        self._mode = "open"
        self._peers: dict[socket.socket, socket.socket] = {}  # each end of a pair -> the other end
        self._wake_r, self._wake_w = socket.socketpair()
        self._state = threading.Condition()
        self._closed = False
        self._requested = self._applied = 0  # mode changes asked for, and applied by the thread
        self._thread = threading.Thread(target=self._run, name=f"tcp-proxy-{self.port}", daemon=True)
        #: connections accepted so far (a test can check that its client went through the proxy)
        self.accepted = 0

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    # -- control -------------------------------------------------------------

    def start(self) -> TCPProxy:
        self._thread.start()
        return self

    def stall(self) -> None:
        self._set("stall")

    def drop(self) -> None:
        self._set("drop")

    def heal(self) -> None:
        self._set("open")

    def close(self) -> None:
        with self._state:
            self._closed = True
        self._wake_w.send(b"x")
        self._thread.join(10)
        assert not self._thread.is_alive(), "the proxy thread did not stop"
        for sock in [*self._peers, self._listener, self._wake_r, self._wake_w]:
            sock.close()
        self._peers.clear()

    def __enter__(self) -> TCPProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _set(self, mode: str) -> None:
        with self._state:
            self._mode = mode
            self._requested += 1
            wanted = self._requested
        self._wake_w.send(b"x")
        with self._state:
            applied = self._state.wait_for(lambda: self._applied >= wanted, timeout=10)
        assert applied, f"the proxy thread did not switch to {mode!r}"

    # -- the thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._state:
                mode, closed, requested = self._mode, self._closed, self._requested
            if closed:
                return
            if mode == "drop":
                self._close_all()
            with self._state:
                self._applied = requested
                self._state.notify_all()
            readers = [self._wake_r]
            if mode != "stall":
                readers += [self._listener, *self._peers]
            ready, _, _ = select.select(readers, [], [])
            for sock in ready:
                if sock is self._wake_r:
                    self._wake_r.recv(_CHUNK)
                elif sock is self._listener:
                    self._accept(mode)
                elif sock in self._peers:
                    self._forward(sock)

    def _accept(self, mode: str) -> None:
        client, _ = self._listener.accept()
        self.accepted += 1
        if mode == "drop":
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        self._peers[client], self._peers[upstream] = upstream, client

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(_CHUNK)
            if data:
                self._peers[sock].sendall(data)
                return
        except OSError:
            pass
        self._close_pair(sock)

    def _close_pair(self, sock: socket.socket) -> None:
        other = self._peers.pop(sock, None)
        sock.close()
        if other is not None:
            self._peers.pop(other, None)
            other.close()

    def _close_all(self) -> None:
        for sock in list(self._peers):
            self._close_pair(sock)
