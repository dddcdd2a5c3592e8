"""Where the ``code`` reward runs model-written programs (``reward.sandbox``):

- ``namespaces`` (`NamespaceSandbox`, the default): on this machine, in new Linux user,
  mount, PID, network, IPC and UTS namespaces, with a read-only view of the standard
  library and system libraries, a fresh /proc, a private size-limited /tmp, no network, as
  an unprivileged user with no capabilities (`namespace_init` says what exactly);
- ``remote`` (`RemoteSandbox`): through an HTTP sandbox service at ``reward.sandbox_url``
  (`protocol`; `service` is a reference service), where user namespaces are not permitted.

Both run a `Run` and answer a `RunResult`. `build_sandbox` makes sure the chosen one can
run a program before any response is scored, and refuses in one line otherwise: programs
never run unsandboxed.
"""
from __future__ import annotations

from functools import lru_cache

from mcore_rl.errors import UsageError
from mcore_rl.rewards.sandbox.namespaces import NamespaceSandbox
from mcore_rl.rewards.sandbox.protocol import Run, RunResult, SandboxError, SandboxLimits

SANDBOXES = ("namespaces", "remote")

__all__ = ["SANDBOXES", "NamespaceSandbox", "Run", "RunResult", "SandboxError", "SandboxLimits",
           "build_sandbox"]


@lru_cache(maxsize=None)
def check_once(sandbox_type: type, url: str = "") -> None:
    """``sandbox_type(...).check()``, once per process for each kind and address."""
    (sandbox_type(url) if url else sandbox_type()).check()


def build_sandbox(kind: str, url: str = "", limits: SandboxLimits = SandboxLimits()):
    """The sandbox ``kind`` (`SANDBOXES`) with ``limits``, once it has run a test program;
    a one-line `UsageError` saying what is missing if it cannot."""
    if kind == "namespaces":
        sandbox = NamespaceSandbox(limits)
        fix = ("allow user namespaces (sysctl user.max_user_namespaces > 0, and "
               "kernel.unprivileged_userns_clone=1 where the kernel has it), or set "
               "reward.sandbox=remote with reward.sandbox_url of a sandbox service, or choose "
               "another reward")
        what = ("runs programs in new Linux namespaces (user, mount, PID, network, IPC), which "
                "this machine does not permit")
    elif kind == "remote":
        from mcore_rl.rewards.sandbox.remote import RemoteSandbox

        if not url.startswith(("http://", "https://")):
            raise UsageError(f"reward.sandbox=remote needs reward.sandbox_url, the http(s):// "
                             f"address of a sandbox service, got {url!r}; set it, or use "
                             "reward.sandbox=namespaces")
        sandbox = RemoteSandbox(url, limits)
        fix = ("start the service (python -m mcore_rl.rewards.sandbox.service) or fix "
               "reward.sandbox_url, or use reward.sandbox=namespaces where user namespaces are "
               "permitted")
        what = f"runs programs through the sandbox service at {url}, which cannot run one"
    else:
        raise UsageError(f"reward.sandbox must be one of {', '.join(SANDBOXES)}, got {kind!r}")
    try:
        check_once(type(sandbox), url if kind == "remote" else "")
    except SandboxError as err:
        reason = " ".join(str(err).split())
        raise UsageError(f"reward 'code' {what} ({reason}); {fix}") from None
    return sandbox
