"""The ranks of an ``mlx.launch`` job: who we are, a small control channel, and a liveness watchdog.

A job started by ``mlx.launch`` (ring over TCP, or JACCL over Thunderbolt) runs one process per
rank with ``MLX_RANK`` set. ``world()`` joins ``mx.distributed`` once and gives:

- ``exchange``: one ``all_gather`` of a fixed ``uint32`` header per rank: the op rank 0 asks for, a
  64-bit fingerprint and three small arguments. Every control message and every divergence check is
  one of these, so the ranks can never pair two different kinds of collective by mistake.
- ``send`` / ``receive``: rank 0's JSON payload after a header (one ``all_sum``; the others add zeros).
- a heartbeat: rank 0 listens on an ephemeral TCP port (told to the others through ``exchange``);
  each pair sends a byte every 0.5 s. A peer that exits or falls silent for ``ONDEVICE_PEER_TIMEOUT``
  seconds (default 5) stops this process with one clear line on stderr, even while it is blocked
  inside a collective: a dead rank never leaves the others hanging. Rank 0 sends "done" at exit.

Only rank 0 writes to stdout: the others point file descriptor 1 at /dev/null when they join.
MLX is imported only here and only when a job was launched with several ranks.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

HEADER = 6  # op, fingerprint hi, fingerprint lo, a, b, c
OP_IDLE, OP_REQUEST, OP_GO, OP_STOP, OP_DONE, OP_FAILED, OP_POLICY, OP_PORT = range(8)
EXIT_PEER_LOST = 3
BEAT_SECONDS = 0.5


def launched() -> bool:
    """Was this process started as one rank of an MLX distributed job (``MLX_RANK`` set by mlx.launch)?"""
    return "MLX_RANK" in os.environ


def fingerprint(*parts) -> int:
    """A 64-bit hash of integer sequences and strings (what each rank is about to compute on)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little")


def _die(message: str, code: int = EXIT_PEER_LOST) -> None:
    """Print one line and end this process now (from any thread, even while MLX blocks in a collective)."""
    try:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


class World:
    """This process's place in the job. Use ``world()`` rather than constructing it.

    Attributes:
        rank, size: this rank and the number of ranks.
        group: the ``mx.distributed.Group``.
        collectives: collectives issued by ondevice itself (headers and payloads), not the model's.
    """

    def __init__(self, timeout: float | None = None) -> None:
        import mlx.core as mx

        self._mx = mx
        self.timeout = float(timeout or os.environ.get("ONDEVICE_PEER_TIMEOUT", 5))
        init_timeout = float(os.environ.get("ONDEVICE_INIT_TIMEOUT", 60))
        rank_env = os.environ.get("MLX_RANK", "?")
        guard = threading.Timer(init_timeout, _die, (f"rank {rank_env}: the other ranks did not connect within "
                                                     f"{init_timeout:.0f} s (check MLX_HOSTFILE / the hosts and ports)",))
        guard.daemon = True
        guard.start()
        try:
            self.group = mx.distributed.init(strict=True, backend=_backend())
        except RuntimeError as e:
            raise OndeviceError(f"rank {rank_env}: could not join the MLX distributed job ({e})") from e
        finally:
            guard.cancel()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.collectives = 0
        self.failed = False
        self.lock = threading.RLock()  # rank 0: one request (a run of collectives) at a time
        self._socks: dict[int, socket.socket] = {}
        self._send_lock = threading.Lock()
        self._closing = False
        if self.rank != 0:
            devnull = os.open(os.devnull, os.O_WRONLY)
            sys.stdout.flush()
            os.dup2(devnull, 1)
        if self.size > 1:
            self._start_heartbeat()

    # -- collectives -----------------------------------------------------------------------------
    def exchange(self, op: int, fp: int = 0, a: int = 0, b: int = 0, c: int = 0) -> np.ndarray:
        """All ranks' headers, [size, 6] uint32 (row r from rank r). A lost peer raises OndeviceError."""
        mx = self._mx
        row = np.array([op, (fp >> 32) & 0xFFFFFFFF, fp & 0xFFFFFFFF, a & 0xFFFFFFFF, b & 0xFFFFFFFF,
                        c & 0xFFFFFFFF], dtype=np.uint32)
        self.collectives += 1
        try:
            out = mx.distributed.all_gather(mx.array(row), group=self.group, stream=mx.cpu)
            return np.array(out).reshape(self.size, HEADER)
        except RuntimeError as e:
            raise OndeviceError(f"rank {self.rank}: lost a peer during a collective ({e})") from e

    def payload(self, obj=None, nbytes: int = 0):
        """Rank 0's ``obj`` (JSON) on every rank; the others pass the ``nbytes`` its header announced."""
        mx = self._mx
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        n = len(data) if self.rank == 0 else nbytes
        buf = np.zeros(max(n, 1), dtype=np.uint8)
        buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.collectives += 1
        try:
            out = np.array(mx.distributed.all_sum(mx.array(buf), group=self.group, stream=mx.cpu))
        except RuntimeError as e:
            raise OndeviceError(f"rank {self.rank}: lost a peer during a collective ({e})") from e
        return json.loads(out[:n].tobytes().decode())

    def send(self, obj) -> None:
        """Rank 0: announce a request and send ``obj`` to every rank (all must be waiting for one)."""
        n = len(json.dumps(obj).encode())
        rows = self.exchange(OP_REQUEST, 0, n)
        busy = [r for r in range(1, self.size) if rows[r, 0] != OP_IDLE]
        if busy:
            self.failed = True
            raise DivergenceError(f"ranks diverged: rank(s) {busy} were still generating when rank 0 had finished")
        self.payload(obj)

    def share(self, obj=None):
        """Rank 0's ``obj`` on every rank, inside a request that all ranks are running."""
        if self.rank == 0:
            self.send(obj)
            return obj
        rows = self.exchange(OP_IDLE)
        if rows[0, 0] != OP_REQUEST:
            self.failed = True
            raise DivergenceError(f"rank {self.rank}: expected data from rank 0, got op {rows[0, 0]}")
        return self.payload(nbytes=int(rows[0, 3]))

    def agree(self, fp: int, op: int = OP_GO, what: str = "step") -> np.ndarray:
        """Check that every rank holds the fingerprint ``fp``; returns the headers.

        Raises:
            DivergenceError on every rank when the fingerprints (or ops) differ.
        """
        rows = self.exchange(op, fp)
        fps = (rows[:, 1].astype(np.uint64) << np.uint64(32)) | rows[:, 2].astype(np.uint64)
        if rows[0, 0] in (OP_GO, OP_DONE) and (len(set(fps.tolist())) > 1 or len(set(rows[:, 0].tolist())) > 1):
            self.failed = True
            odd = [r for r in range(self.size) if fps[r] != fps[0] or rows[r, 0] != rows[0, 0]]
            raise DivergenceError(
                f"ranks diverged at a {what}: rank(s) {odd} disagree with rank 0 on what was emitted "
                "(different drafts, random numbers or tokenizer files on the machines); all ranks stop"
            )
        return rows

    # -- heartbeat -------------------------------------------------------------------------------
    def _root_ip(self) -> str:
        hostfile = os.environ.get("MLX_HOSTFILE")
        try:
            if hostfile and os.path.isfile(hostfile):
                hosts = json.loads(open(hostfile).read() or "[]")
                return str(hosts[0][0]).rsplit(":", 1)[0] if hosts else "127.0.0.1"
        except (ValueError, IndexError, KeyError, TypeError):
            pass
        coord = os.environ.get("MLX_JACCL_COORDINATOR")
        return coord.rsplit(":", 1)[0] if coord else "127.0.0.1"

    def _start_heartbeat(self) -> None:
        if self.rank == 0:
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.bind((self._root_ip(), 0))
            srv.listen(self.size)
            self.exchange(OP_PORT, 0, srv.getsockname()[1])
            srv.settimeout(30)
            for _ in range(self.size - 1):
                try:
                    conn, _ = srv.accept()
                    peer = int.from_bytes(conn.recv(4), "little")
                except OSError as e:
                    _die(f"rank 0: a rank did not open its heartbeat connection ({e})")
                self._socks[peer] = conn
            srv.close()
            atexit.register(self._goodbye)
        else:
            rows = self.exchange(OP_IDLE)
            port = int(rows[0, 3])
            try:
                conn = socket.create_connection((self._root_ip(), port), timeout=30)
            except OSError as e:
                _die(f"rank {self.rank}: cannot reach rank 0's heartbeat at {self._root_ip()}:{port} ({e})")
            conn.sendall(self.rank.to_bytes(4, "little"))
            self._socks[0] = conn
        for peer, conn in self._socks.items():
            conn.settimeout(self.timeout)
            threading.Thread(target=self._watch, args=(peer, conn), name=f"ondevice-watch-{peer}", daemon=True).start()
        threading.Thread(target=self._beat, name="ondevice-beat", daemon=True).start()

    def _beat(self) -> None:
        while not self._closing:
            with self._send_lock:
                for conn in list(self._socks.values()):
                    try:
                        conn.sendall(b".")
                    except OSError:
                        pass  # the watcher reports it
            time.sleep(BEAT_SECONDS)

    def _watch(self, peer: int, conn: socket.socket) -> None:
        who = "rank 0" if peer == 0 else f"rank {peer}"
        me = f"rank {self.rank}"
        while True:
            try:
                data = conn.recv(64)
            except TimeoutError:
                if self._closing:
                    return
                _die(f"{me}: {who} has not answered for {self.timeout:.0f} s (machine or link down?); stopping")
            except OSError as e:
                if self._closing:
                    return
                _die(f"{me}: lost the connection to {who} ({e}); stopping")
            if b"x" in data:  # the peer finished normally
                if self.rank != 0:  # rank 0 is done: so is this rank
                    sys.stderr.flush()
                    os._exit(1 if self.failed else 0)
                return
            if not data:
                if self._closing:
                    return
                _die(f"{me}: {who} exited unexpectedly (see its error above); stopping all ranks")

    def _goodbye(self) -> None:
        """Rank 0 at exit: tell every rank to finish."""
        self._closing = True
        with self._send_lock:
            for conn in self._socks.values():
                try:
                    conn.sendall(b"x")
                    conn.close()
                except OSError:
                    pass


class DivergenceError(OndeviceError):
    """The ranks no longer compute on the same tokens; the job cannot continue."""


def _backend() -> str:
    if os.environ.get("MLX_HOSTFILE"):
        return "ring"
    if os.environ.get("MLX_JACCL_COORDINATOR") or os.environ.get("MLX_IBV_DEVICES"):
        return "jaccl"
    return "any"


_WORLD: World | None = None
_WORLD_LOCK = threading.Lock()


def world() -> World:
    """This process's ``World`` (joined on first use)."""
    global _WORLD
    with _WORLD_LOCK:
        if _WORLD is None:
            try:
                import mlx.core  # noqa: F401
            except ImportError as e:
                raise OndeviceError("MLX_RANK is set but MLX is not installed: pip install 'ondevice[mlx]'") from e
            _WORLD = World()
        return _WORLD


def active() -> bool:
    """Launched with more than one rank (joins the job on first call)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile) and not Path(hostfile).read_text().strip():
        return False  # mlx.launch -n 1 writes an empty hostfile: a job of one
    return launched() and world().size > 1
