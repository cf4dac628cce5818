"""The ``ssh`` launcher: peers on real hosts from an inventory, driven by the OpenSSH client.

Peer ``i`` runs on host ``i mod len(hosts)``, the bootstrap node and the baseline on the first
host. Every process is one ``ssh host -- sh -c ...`` whose stdout and stderr stream back into
the local run directory; the remote shell writes its pid to ``<name>.pid`` and ``exec``s the
process, so stopping is ``kill -TERM <pid>`` over SSH (a dropped SSH connection alone would not
stop it). Metrics streams are written on the host under ``<workdir>/<sweep>/<config>/`` and
copied back (``tar`` over SSH) while the target-loss rule watches and at the end. One SSH master
connection per host (``ControlMaster``) carries all of a sweep's commands. Hosts need
volunteer-peer installed for ``python`` (a venv path) and ``taskset`` for CPU pinning.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from experiments.launch.base import Launcher, LaunchError, PopenHandle, ProcessPlan, Session
from experiments.spec import HostSpec, SshSpec

COMMAND_TIMEOUT_S = 60.0


class SshClient:
    """``ssh`` command lines for one host, sharing a master connection."""

    def __init__(self, host: HostSpec, control_dir: Path, connect_timeout_s: float):
        self.host = host
        self.target = f"{host.user}@{host.host}" if host.user else host.host
        self.options = [
            "-p", str(host.port),
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={max(1, round(connect_timeout_s))}",
            "-o", "ControlMaster=auto",
            "-o", f"ControlPath={control_dir}/%C",
            "-o", "ControlPersist=120",
            "-o", "ServerAliveInterval=15",
        ]  # fmt: skip
        if host.key is not None:
            self.options += ["-i", str(host.key), "-o", "IdentitiesOnly=yes"]
        for option in host.ssh_options:
            self.options += ["-o", option]

    def command(self, remote: str) -> list[str]:
        """The local argv that runs shell command ``remote`` on the host."""
        return ["ssh", *self.options, self.target, "--", remote]

    def run(self, remote: str, *, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S):
        """Run ``remote`` and wait for it.

        Raises:
            LaunchError: ssh failed (with ``check``), with its stderr.
        """
        try:
            done = subprocess.run(
                self.command(remote), capture_output=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(f"ssh {self.target}: no answer in {timeout_s:.0f} s") from None
        if check and done.returncode != 0:
            error = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
            raise LaunchError(f"ssh {self.target} ({done.returncode}): {' '.join(error)}")
        return done

    def close(self) -> None:
        subprocess.run(
            ["ssh", *self.options, "-O", "exit", self.target],
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )


class SshHandle(PopenHandle):
    """A remote process: the local ssh client's lifetime is the process's; signals go by pid."""

    def __init__(self, plan: ProcessPlan, client: SshClient, remote_dir: str, run_dir: Path):
        self.client, self.pid_file = client, f"{remote_dir}/{plan.name}.pid"
        super().__init__(plan.name, self._argv(plan, remote_dir), run_dir, dict(os.environ))

    def _argv(self, plan: ProcessPlan, remote_dir: str) -> list[str]:
        host = self.client.host
        command = [host.python, *plan.args]
        if plan.listens:
            command += ["--host", host.listen_host, "--announce-host", host.host]
        if plan.metrics:
            command += ["--metrics-file", f"{plan.name}.jsonl"]  # in remote_dir, see the cd
        if plan.cpus is not None:
            command = ["taskset", "-c", ",".join(map(str, plan.cpus)), *command]
        env = [f"{key}={value}" for key, value in plan.env.items()]
        script = (
            f"cd {shlex.quote(remote_dir)} && echo $$ > {shlex.quote(plan.name)}.pid && "
            f"exec env {shlex.join(env)} {shlex.join(command)}"
        )
        return self.client.command(f"sh -c {shlex.quote(script)}")

    def _signal(self, name: str) -> None:
        pid = f"$(cat {shlex.quote(self.pid_file)} 2>/dev/null)"
        self.client.run(f"kill -{name} {pid} 2>/dev/null; true", check=False)

    def terminate(self) -> None:
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self._signal("TERM")

    def kill(self) -> None:
        if self.process.poll() is None:
            self._signal("KILL")
        super().kill()


class SshSession(Session):
    """One configuration on the inventory's hosts; see the module docstring."""

    def __init__(self, run_dir: Path, clients: list[SshClient], num_peers: int):
        super().__init__(run_dir)
        self.clients = clients
        self.remote_dir = {
            id(c): f"{c.host.workdir}/{run_dir.parent.name}/{run_dir.name}" for c in clients
        }
        self.used = clients[: max(1, min(num_peers, len(clients)))]
        for client in self.used:
            directory = shlex.quote(self.remote_dir[id(client)])
            client.run(f"rm -rf {directory} && mkdir -p {directory}")
        self._closed = False

    def client_of(self, plan: ProcessPlan) -> SshClient:
        return self.clients[(plan.index or 0) % len(self.clients)]

    def start(self, plan: ProcessPlan) -> SshHandle:
        client = self.client_of(plan)
        if plan.cpus is not None and plan.index is not None:
            # CPU ids are the host's: the peers sharing a host take consecutive blocks of it
            size, local = len(plan.cpus), plan.index // len(self.clients)
            plan = dataclasses.replace(plan, cpus=list(range(local * size, (local + 1) * size)))
        handle = SshHandle(plan, client, self.remote_dir[id(client)], self.run_dir)
        self.handles.append(handle)
        return handle

    def refresh(self, name: str, kind: str = "jsonl") -> None:
        if kind != "jsonl":
            return  # stdout and stderr stream back over the ssh connection already
        plan_index = int(name.rsplit("-", 1)[1]) if name.startswith("peer-") else 0
        client = self.clients[plan_index % len(self.clients)]
        path = f"{self.remote_dir[id(client)]}/{name}.{kind}"
        done = client.run(f"cat {shlex.quote(path)} 2>/dev/null; true", check=False)
        if done.returncode == 0 and done.stdout:
            (self.run_dir / f"{name}.{kind}").write_bytes(done.stdout)

    def collect(self) -> None:
        """Copy every host's metrics streams of this configuration back (tar over ssh)."""
        for client in self.used:
            directory = shlex.quote(self.remote_dir[id(client)])
            done = client.run(f"cd {directory} && tar -cf - --exclude='*.pid' .", check=False)
            if done.returncode == 0:
                subprocess.run(
                    ["tar", "-xf", "-", "-C", str(self.run_dir)],
                    input=done.stdout,
                    capture_output=True,
                    check=False,
                )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.stop_all(grace_s=5.0)
        finally:
            for client in self.used:  # anything that outlived its ssh connection
                directory = shlex.quote(self.remote_dir[id(client)])
                client.run(
                    f"for f in {directory}/*.pid; do kill -KILL $(cat $f) 2>/dev/null; done; true",
                    check=False,
                )


class SshLauncher(Launcher):
    """See the module docstring."""

    name = "ssh"

    def __init__(self, spec: SshSpec):
        self.spec = spec
        self._control_dir = Path(tempfile.mkdtemp(prefix="vpx-ssh-"))
        self.clients = [
            SshClient(host, self._control_dir, spec.connect_timeout_s) for host in spec.hosts
        ]

    def check(self) -> None:
        if shutil.which("ssh") is None:
            raise LaunchError("the ssh launcher needs the OpenSSH client (`ssh`)")
        for client in self.clients:
            done = client.run(f"{shlex.quote(client.host.python)} -c 'import peer'", check=False)
            if done.returncode == 255:
                error = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
                raise LaunchError(f"ssh {client.target}: cannot connect: {' '.join(error)}")
            if done.returncode != 0:
                raise LaunchError(
                    f"ssh {client.target}: {client.host.python} cannot import volunteer-peer "
                    "(install it there, or set python to its venv's python)"
                )

    def open_session(self, run_dir: Path, num_peers: int) -> SshSession:
        return SshSession(run_dir, self.clients, num_peers)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        shutil.rmtree(self._control_dir, ignore_errors=True)
