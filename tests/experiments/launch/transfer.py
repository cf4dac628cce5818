"""``python -m tests.experiments.launch.transfer serve PORT SECONDS`` / ``send HOST PORT SECONDS``.

serve: accept one connection, count the bytes it receives for SECONDS after the first byte, and
print ``{"bytes": N, "seconds": S}``. send: write as fast as the socket takes it for SECONDS.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = b"\0" * 65536


def serve(port: int, seconds: float) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            first = connection.recv(65536)
            start, total = time.monotonic(), 0
            while time.monotonic() - start < seconds:
                data = connection.recv(65536)
                if not data:
                    break
                total += len(data)
            elapsed = time.monotonic() - start
    print(json.dumps({"bytes": total, "seconds": elapsed, "first": len(first)}), flush=True)


def send(host: str, port: int, seconds: float) -> None:
    with socket.create_connection((host, port), timeout=10) as connection:
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                connection.sendall(CHUNK)
        except OSError:
            pass  # the server stopped reading


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), float(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
