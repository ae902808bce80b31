"""Starting, stopping and inspecting roles: detached local processes or systemd units."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from launch.pdlib import loadfiles
from launch.pdlib.files import write_whole
from launch.pdlib.stack import ROOT, Role, Stack


class SuperviseError(RuntimeError):
    """A role cannot be started or stopped as asked; nothing further was done to it."""


@dataclass(frozen=True)
class State:
    running: bool
    pid: int | None
    detail: str


def port_owner(port: int) -> int | None:
    """Pid of the process listening on TCP `port` (any address), if any."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


def describe_pid(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return f"pid {pid} ({' '.join(proc.cmdline())[:120]})"
    except psutil.Error:
        return f"pid {pid}"


def private_run_dir(path: Path) -> None:
    """Make the run dir (0700), or take the one there if it is this user's: pid files, logs and
    secrets go there, and what pd reads back from it decides which processes it signals. A
    directory another user owns is refused (they could plant or swap files in it), and a link
    is never chmodded through, only followed to a directory of ours that nobody else can write."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not path.is_symlink():
            raise
        st = path.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise SuperviseError(
                f"run dir {path} is a link to a directory of uid {st.st_uid}, mode "
                f"{st.st_mode & 0o7777:04o}: it must be this user's ({os.geteuid()}) and "
                "writable by nobody else; choose another PD_RUN_DIR"
            ) from None
        return
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise SuperviseError(
                f"run dir {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
                "it could plant files there that launch/pd reads and signals; choose another "
                "PD_RUN_DIR"
            )
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def recorded_process(path: Path) -> psutil.Process | None:
    """The live process a pid file names, when it is still the one that was recorded (a pid
    number can be reused; the start time tells our process from a newcomer)."""
    try:
        record = json.loads(path.read_text())
        proc = psutil.Process(int(record["pid"]))
        if abs(proc.create_time() - float(record["create_time"])) > 1.0:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (ValueError, KeyError, TypeError, OSError, psutil.Error):
        return None


def tail(path: Path, lines: int) -> list[str]:
    if not path.is_file():
        return [f"(no log at {path})"]
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 256 * 1024))
        text = f.read().decode(errors="replace")
    return text.splitlines()[-lines:]


class LocalSupervisor:
    """Each instance is a process group of its own, in the caller's session; pid file and log
    under the run dir, named by its key (decode, or decode-2 for instance 2 of several)."""

    kind = "local"

    def __init__(self, stack: Stack, env_dir: Path, stop_grace_s: float = 20.0):
        self.stack = stack
        self.env_dir = Path(env_dir).resolve()
        self.run_dir = stack.run_dir
        self.stop_grace_s = stop_grace_s

    def pid_file(self, role: str) -> Path:
        return self.run_dir / f"{role}.pid"

    def log_file(self, role: str) -> Path:
        return self.run_dir / f"{role}.log"

    def _recorded(self, role: str) -> psutil.Process | None:
        path = self.pid_file(role)
        if not path.is_file():
            return None
        return recorded_process(path)

    def state(self, role: str) -> State:
        proc = self._recorded(role)
        if proc is not None:
            return State(True, proc.pid, f"running, pid {proc.pid}")
        if self.pid_file(role).is_file():
            return State(False, None, "not running (process in the pid file has exited)")
        return State(False, None, "not running")

    def start(self, role: Role) -> State:
        current = self.state(role.key)
        if current.running:
            raise SuperviseError(f"{role.name} already running (pid {current.pid})")
        owner = port_owner(role.port)
        if owner is not None:
            raise SuperviseError(
                f"{role.name}: port {role.port} is already held by {describe_pid(owner)}; "
                "not starting a second server"
            )
        # Private: patch 0009 redacts the key in sglang's start-up server_args line, but a
        # failing process may print more than that.
        private_run_dir(self.run_dir)
        cmd = [str(role.script), "--env-dir", str(self.env_dir)]
        if role.index is not None:
            cmd += ["--instance", str(role.index)]
        if self.stack.sim:
            cmd.append("--sim")
        fd = os.open(
            self.log_file(role.key),
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        os.fchmod(fd, 0o600)
        log = os.fdopen(fd, "ab")
        log.write(
            f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} launch/pd starting {role.name}"
            f"{' (sim)' if self.stack.sim else ''}\n".encode()
        )
        log.flush()
        # A process group of its own (stopped and signalled as one), in the caller's session,
        # not a new one: with the kernel's autogroup scheduling (on by default in Debian's and
        # Ubuntu's kernels), each session is one scheduling group and a thread's nice value
        # only counts inside its group. An engine in a session of its own would give its NIXL
        # progress thread, polling at nice 19 (SGLANG_DISAGGREGATION_NIXL_THREAD_NICE) while
        # the engine waits, a whole group's share of the CPU against the engine that computes.
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        log.close()
        record = {
            "pid": proc.pid,
            "create_time": psutil.Process(proc.pid).create_time(),
            "sim": self.stack.sim,
        }
        write_whole(self.pid_file(role.key), json.dumps(record) + "\n", 0o600)
        return State(True, proc.pid, f"started, pid {proc.pid}")

    def processes(self, role: str) -> list[psutil.Process]:
        """The instance's process group as it runs now: its main process and their children."""
        proc = self._recorded(role)
        if proc is None:
            return []
        try:
            return [proc] + proc.children(recursive=True)
        except psutil.Error:
            return [proc]

    def stop(self, role: Role) -> State:
        """SIGTERM to the process group, SIGKILL after the grace; then its load snapshot file
        goes (launch/pdlib/loadfiles.py), also when the instance had already died."""
        group = self.processes(role.key)
        if not group:
            self.pid_file(role.key).unlink(missing_ok=True)
            gone = loadfiles.remove(self.run_dir, role.key, set(), [])
            return State(False, None, "was not running" + loadfiles.said(gone))
        proc = group[0]
        names = loadfiles.open_by(group)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        alive = wait_exited(group, timeout=self.stop_grace_s)
        detail = f"stopped pid {proc.pid}"
        if alive:
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            wait_exited(alive, timeout=5)
            detail += (
                f" (killed {len(alive)} process(es) still alive after {self.stop_grace_s:g} s)"
            )
        self.pid_file(role.key).unlink(missing_ok=True)
        detail += loadfiles.said(loadfiles.remove(self.run_dir, role.key, names, group))
        owner = port_owner(role.port)
        if owner is not None:
            raise SuperviseError(
                f"{role.name}: port {role.port} still held by {describe_pid(owner)} after stop"
            )
        return State(False, None, detail)

    def restart(self, role: Role) -> State:
        stopped = self.stop(role)
        started = self.start(role)
        return State(True, started.pid, f"{stopped.detail}; {started.detail}")

    def alive(self, role: str) -> bool:
        return self._recorded(role) is not None

    def logs(self, role: str, lines: int) -> list[str]:
        return tail(self.log_file(role), lines)


def wait_exited(procs: list[psutil.Process], timeout: float, poll_s: float = 0.05) -> list:
    """The processes still running after up to `timeout` seconds. One that has exited counts
    as gone at once, reaped or not: a server started by an earlier launch/pd call is not our
    child, and its zombie lasts until init reaps it, which here took about a second."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
            except psutil.Error:
                alive.append(proc)
        if not alive or time.monotonic() >= deadline:
            return alive
        procs = alive
        time.sleep(poll_s)


def processes_naming(marker: Path) -> list[psutil.Process]:
    """Processes whose command line names `marker` (the launch scripts pass --env-dir on)."""
    needle = str(Path(marker).resolve())
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(needle in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def sweep(run_dir: Path, marker: Path) -> int:
    """Kill what a `down` left behind: the processes recorded in run_dir (still the ones that
    were started: a reused pid is left alone) and every process whose command line names
    `marker`, with their children. Returns how many were found."""
    targets = []
    for path in Path(run_dir).glob("*.pid") if Path(run_dir).is_dir() else []:
        proc = recorded_process(path)
        if proc is not None:
            targets.append(proc)
    targets += processes_naming(marker)
    for proc in targets:
        try:
            for child in proc.children(recursive=True):
                child.kill()
            proc.kill()
        except psutil.Error:
            pass
    return len(targets)


class SystemdSupervisor:
    """Each instance is the unit PREFIX-KEY.service (templates in launch/systemd/): KEY is the
    role, or ROLE-N for instance N of several."""

    kind = "systemd"

    def __init__(self, stack: Stack):
        self.stack = stack
        self.timeout_s = stack.systemctl_timeout_s

    def unit(self, role: str) -> str:
        return f"{self.stack.unit_prefix}-{role}.service"

    def _systemctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["systemctl", *args], capture_output=True, text=True, timeout=self.timeout_s
        )

    def _active(self, role: str) -> str:
        try:
            return self._systemctl("is-active", self.unit(role)).stdout.strip() or "unknown"
        except subprocess.TimeoutExpired:
            return "unknown (systemctl is-active timed out)"

    def _main_pid(self, role: str) -> int | None:
        try:
            out = self._systemctl("show", "-p", "MainPID", "--value", self.unit(role)).stdout
        except subprocess.TimeoutExpired:
            return None
        pid = int(out.strip() or 0) if out.strip().isdigit() else 0
        return pid or None

    def state(self, role: str) -> State:
        active = self._active(role)
        pid = self._main_pid(role) if active in ("active", "activating", "reloading") else None
        running = active in ("active", "activating", "reloading")
        return State(
            running, pid, f"unit {self.unit(role)} {active}" + (f", pid {pid}" if pid else "")
        )

    def processes(self, role: str) -> list[psutil.Process]:
        """The unit's main process and its children, while it runs."""
        pid = self._main_pid(role)
        try:
            proc = psutil.Process(pid) if pid else None
            return [proc] + proc.children(recursive=True) if proc else []
        except psutil.Error:
            return []

    def _drive(self, verb: str, role: Role) -> State:
        stopping = self.processes(role.key) if verb in ("stop", "restart") else []
        names = loadfiles.open_by(stopping)
        state = self._systemctl_drive(verb, role)
        if verb in ("stop", "restart"):
            gone = loadfiles.remove(self.stack.run_dir, role.key, names, stopping)
            state = State(state.running, state.pid, state.detail + loadfiles.said(gone))
        return state

    def _systemctl_drive(self, verb: str, role: Role) -> State:
        try:
            done = self._systemctl(verb, self.unit(role.key))
        except subprocess.TimeoutExpired:
            # A slow systemctl is not a failed unit: look at the unit before deciding anything,
            # and never issue the command a second time.
            now = self.state(role.key)
            if (verb == "stop") != now.running:
                return State(
                    now.running,
                    now.pid,
                    f"systemctl {verb} timed out after {self.timeout_s:g} s; "
                    f"{now.detail}, carrying on",
                )
            raise SuperviseError(
                f"systemctl {verb} {self.unit(role.key)} timed out after {self.timeout_s:g} s "
                f"and the unit is {now.detail}"
            ) from None
        if done.returncode != 0:
            raise SuperviseError(
                f"systemctl {verb} {self.unit(role.key)} exited {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()}"
            )
        now = self.state(role.key)
        return State(now.running, now.pid, f"systemctl {verb}: {now.detail}")

    def start(self, role: Role) -> State:
        return self._drive("start", role)

    def stop(self, role: Role) -> State:
        return self._drive("stop", role)

    def restart(self, role: Role) -> State:
        return self._drive("restart", role)

    def alive(self, role: str) -> bool:
        return self.state(role).running

    def logs(self, role: str, lines: int) -> list[str]:
        try:
            done = subprocess.run(
                ["journalctl", "-u", self.unit(role), "-n", str(lines), "--no-pager"],
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [f"(journalctl failed: {exc})"]
        return (done.stdout or done.stderr).splitlines()[-lines:]


def remove_secret(run_dir: Path, role: Role) -> bool:
    """Remove the file launch/lib.sh wrote the API key to for this role (0600, under
    PD_RUN_DIR/secrets: KEY.yaml for an engine, router.key), once its process is down; True
    when there was one."""
    name = f"{role.key}.key" if role.kind == "router" else f"{role.key}.yaml"
    path = Path(run_dir) / "secrets" / name
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def supervisor_for(stack: Stack, env_dir: Path):
    if stack.supervisor == "systemd":
        return SystemdSupervisor(stack)
    return LocalSupervisor(stack, env_dir)
