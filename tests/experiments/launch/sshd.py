"""A real OpenSSH server on 127.0.0.1 for the ssh launcher's tests, with generated keys."""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
START_TIMEOUT_S = 20.0


def why_not() -> str | None:
    if not Path(SSHD).exists():
        return f"{SSHD} missing (install openssh-server)"
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} missing (install openssh-client)"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Sshd:
    """sshd in the foreground on 127.0.0.1; ``client_key`` logs in as the current user."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        self.user = getpass.getuser()
        self.client_key = directory / "client_key"
        for key in (directory / "host_key", self.client_key):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True
            )
        authorized = directory / "authorized_keys"
        authorized.write_text((directory / "client_key.pub").read_text())
        authorized.chmod(0o600)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation directory
        self.port = _free_port()
        config = directory / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {directory / 'host_key'}\n"
            f"AuthorizedKeysFile {authorized}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            f"StrictModes no\nUsePAM no\nPidFile {directory / 'sshd.pid'}\nLogLevel ERROR\n"
            "MaxStartups 100\nMaxSessions 100\n"
        )
        self.process = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=(directory / "sshd.log").open("wb"),
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sshd did not start: {(directory / 'sshd.log').read_text()}"
                    ) from None
                time.sleep(0.1)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
