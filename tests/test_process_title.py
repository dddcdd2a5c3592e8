"""`mcore_rl.process_title`: a spawned process is named whatever its environment went
through first. setproctitle, called by the target itself, misses when the first environment
variable was set again before (as the parent's ``__main__`` module does when the child runs
it, a Ray worker's importing Ray, and as unpickling the arguments does, importing vLLM,
torch or OpenCV). The spawning process runs with a variable of the test's first in its
environment, so the child inherits it as its first one; both the child's run of the main
module and the unpickling of an argument set it again."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SPAWNER = r'''
import json, multiprocessing, os, sys, time

import psutil

if __name__ == "__mp_main__":  # the child runs this module first, as Ray's worker module
    os.environ["MCORE_RL_FIRST"] = "set by the main module"


def set_first_variable_again():
    os.environ["MCORE_RL_FIRST"] = "set again"
    return "argument"


class SetsTheFirstVariableWhenUnpickled:
    def __reduce__(self):
        return set_first_variable_again, ()


def title_itself(title, queue, _argument):
    import setproctitle

    setproctitle.setproctitle(title)
    queue.put(os.getpid())
    time.sleep(60)


def wait(queue, _argument):
    queue.put(os.getpid())
    time.sleep(60)


if __name__ == "__main__":
    from mcore_rl.process_title import titled

    context = multiprocessing.get_context("spawn")
    names = {}
    for way, target, args in [
            ("itself", title_itself, ("T::itself",)),
            ("titled", titled, ("T::titled", wait))]:
        queue = context.Queue()
        proc = context.Process(target=target, args=(*args, queue, SetsTheFirstVariableWhenUnpickled()),
                               daemon=True)
        proc.start()
        names[way] = psutil.Process(queue.get(timeout=120)).cmdline()[:1]
        proc.kill()
    print(json.dumps(names))
'''


def test_a_spawned_target_is_titled_even_when_its_arguments_set_the_first_variable(tmp_path):
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    env = {"MCORE_RL_FIRST": "first", **os.environ}  # the first variable the child inherits
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = json.loads(proc.stdout.splitlines()[-1])
    # the failure this guards against: a title set after the variable was set again is lost
    assert names["itself"] != ["T::itself"], names
    assert names["titled"] == ["T::titled"], names
