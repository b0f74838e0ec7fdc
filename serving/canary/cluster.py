"""The Ray cluster a `fuselane canary` command works on: which one, and joining it.

- **Which one.** `--address auto` (the default) is the cluster with a node on this machine,
  found where `ray.init(address="auto")` looks: the raylet processes' GCS addresses. Where
  several run, Ray takes the last `ray start`'s or any one of them (a set: a different one from
  call to call); here that is an error that names them. `RAY_ADDRESS` counts as explicit, as
  it does for Ray.
- **Joining.** A cluster on 127.0.0.1 (the demo's) is joined as a node on 127.0.0.1
  (`ray_compat.loopback_node`; Ray would otherwise look for it on the machine's routable
  address, where nothing listens). Ray sends the token (~/.ray/auth_token) to a cluster it
  found with `auto`, never to an explicit address; an explicit address of a cluster on this
  machine gets what `auto` would give it. What fails is one line (`ClusterError`): an
  unreachable cluster, a refused token, with how to fix it. Ray's C++ warnings while it
  retries are kept off the terminal and read for the cause.

Ray's private names for this are in ray_compat (cheap to import: nothing here may import Ray
Serve LLM or vLLM, seconds of imports and their log lines, before the cluster is joined).
"""

from __future__ import annotations

import ipaddress
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO

from . import ray_compat

ADDRESS_ENV = "RAY_ADDRESS"
TOKEN_HINT = (
    "give this client the cluster's token: RAY_AUTH_MODE=token, and the token in "
    "~/.ray/auth_token or RAY_AUTH_TOKEN (`ray get-auth-token` prints it on a node of the cluster)"
)


class ClusterError(RuntimeError):
    """What failed, and how to fix it, in one line for the user."""


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def choose_address(
    address: str | None, env: str | None, running: Iterable[str], latest: str | None = None
) -> str:
    """The cluster to join: `address`, or for `auto` / None the value of RAY_ADDRESS (`env`),
    else the one cluster of this machine among `running` (`latest`: the last `ray start`'s, named
    in the error). Raises ClusterError for none or several."""
    if address not in (None, "", "auto"):
        return address
    if env and env != "auto":
        return env
    found = sorted(running)
    if not found:
        raise ClusterError(
            "no Ray cluster runs on this machine: start one (`ray start --head`) or name one "
            "with --address HOST:PORT"
        )
    if len(found) > 1:
        names = ", ".join(a + (" (the last `ray start`)" if a == latest else "") for a in found)
        raise ClusterError(
            f"{len(found)} Ray clusters run on this machine: {names}; "
            "say which with --address (or RAY_ADDRESS)"
        )
    return found[0]


def resolve_address(address: str | None) -> str:
    """`choose_address` with this machine's clusters, looked up only where `address` and
    RAY_ADDRESS leave the choice to them."""
    env = os.environ.get(ADDRESS_ENV)
    if address not in (None, "", "auto") or (env and env != "auto"):
        return choose_address(address, env, ())
    running = ray_compat.find_gcs_addresses()
    latest = ray_compat.latest_ray_start_address() if len(running) > 1 else None
    return choose_address(address, env, running, latest)


@contextmanager
def redirect_fds(path: str, fds: tuple[int, ...]) -> Iterator[dict[int, TextIO]]:
    """The file descriptors `fds` (1: stdout, 2: stderr) into `path` (appended) for the block:
    Ray's C++ logs and every log handler bound to the process's streams included, which
    replacing `sys.stdout` / `sys.stderr` would miss. Yields text streams on what they were,
    for what must still reach the terminal."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in fds}
    with open(path, "ab") as f:
        for fd in fds:
            os.dup2(f.fileno(), fd)
    originals = {fd: os.fdopen(os.dup(s), "w", buffering=1) for fd, s in saved.items()}
    try:
        yield originals
    finally:
        for stream in (sys.stdout, sys.stderr, *originals.values()):
            stream.flush()
        for fd, s in saved.items():
            os.dup2(s, fd)
            os.close(s)
        for stream in originals.values():
            stream.close()


def _failure(address: str, error: BaseException, ray_log: str) -> str:
    """One line from what `ray.init` raised and what Ray's C++ side logged meanwhile."""
    text = f"{error} {ray_log}"
    if type(error).__name__ == "AuthenticationError" or "InvalidAuthToken" in text:
        if "no authentication token was found" in text:
            return f"the Ray cluster at {address} wants a token and this client has none: " + (
                TOKEN_HINT
            )
        return (
            f"the Ray cluster at {address} refused this client's token (token authentication "
            f"is on there, and the token sent is missing or another one): {TOKEN_HINT}"
        )
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"cannot join the Ray cluster at {address}: {first}; check the address "
        "(`ray status --address ADDRESS`; on this machine --address auto finds it)"
    )


@contextmanager
def _loopback_if(on: bool) -> Iterator[None]:
    if on:
        with ray_compat.loopback_node():
            yield
    else:
        yield


def connect(address: str | None) -> str:
    """Join the cluster (see the module's docstring); returns its address. A no-op in a process
    already connected (the tests', the demo's)."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    target = resolve_address(address)
    if is_loopback(target) or target in ray_compat.find_gcs_addresses():
        ray_compat.enable_token_auth_if_token_available()
    fd, log = tempfile.mkstemp(prefix="fuselane-ray-connect-", suffix=".log")
    os.close(fd)
    try:
        with redirect_fds(log, (2,)), _loopback_if(is_loopback(target)):
            ray.init(address=target, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, TimeoutError, ValueError) as e:
        # AuthenticationError is a RayError (a RuntimeError) too.
        with open(log, errors="replace") as f:
            raise ClusterError(_failure(target, e, f.read())) from None
    finally:
        os.unlink(log)
    return target
