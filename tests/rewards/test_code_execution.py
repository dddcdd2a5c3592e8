"""The ``code`` reward: fraction of tests passed, in a sandbox with a time limit, a memory
limit and no network; refused where no namespace can be made. (What the sandbox keeps a
hostile program from doing: test_code_sandbox.py.)"""
import socket
import subprocess
import sys
import time

import pytest

from mcore_rl.config.sections import RewardConfig
from mcore_rl.rewards import RewardError, RewardScorer
from mcore_rl.rewards.code_execution import code_reward, extract_program, value_test
from tests.rewards.unsandboxed import Unsandboxed

ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]}


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


def code_scorer(**options) -> RewardScorer:
    return RewardScorer.from_config(RewardConfig(name="code", failure_score=-1.0, **options))


def test_the_program_is_the_last_python_block_else_the_whole_response():
    assert extract_program("```py\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_program("print(1)") == "print(1)"


def test_score_is_the_fraction_of_code_and_stdin_tests_passed():
    io = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2", "output": "4"},
                    {"input": "5 5", "output": "11"}, {"input": "-1 1", "output": "0  \n\n"}]}
    sum_program = fenced("a, b = map(int, input().split())\nprint(a + b)")
    responses = [fenced("def add(a, b):\n    return a + b"),  # all pass
                 fenced("def add(a, b):\n    return a * b"),  # add(2, 2) passes only
                 "def add(a, b):\n    return b",              # no fence: add(0, 5) passes
                 sum_program]                                  # 3 of 4 (5+5 != 11)
    with code_scorer(workers=2) as s:
        scores, metrics = s.score([""] * 4, responses, [ADD_TESTS] * 3 + [io])
    assert scores.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 0.75])
    assert metrics["reward/failures"] == metrics["reward/timeouts"] == 0


def test_an_assert_of_an_expression_equal_to_a_literal_is_a_value_test_and_nothing_else_is():
    assert value_test("assert add(1, 2) == 3") == ("add(1, 2)", 3)
    assert value_test("assert [1, (2, 'a')] == f(x)[0]") == ("f(x)[0]", [1, (2, "a")])
    assert value_test("assert add(1, 2) == 3, 'message'") == ("add(1, 2)", 3)
    for other in ("assert add(1, 2) != 3", "assert add(1, 2) == 3 == x", "assert f(x) == y",
                  "assert 3 == 3", "assert f(x)", "x = 1\nassert f(x) == 2", "f(1) == 2",
                  "assert f(x) == ", "assert f(x) == 1 + 2"):
        assert value_test(other) is None, other


def test_values_compare_as_the_same_assert_would_for_builtin_types_and_fail_otherwise():
    """Only expressions enter the sandbox; what comes back is compared here."""
    program = """
import collections
def f(kind):
    return {"named tuple": collections.namedtuple("P", "x y")(1, 2),
            "ordered dict": collections.OrderedDict(a=1), "frozenset": frozenset({1, 2}),
            "true": True, "float": 2.0, "str subclass": type("S", (str,), {})("ab"),
            "fraction": __import__("fractions").Fraction(1, 2), "raises": None}[kind]
def g():
    raise ValueError
"""
    tests = ["assert f('named tuple') == (1, 2)", "assert f('ordered dict') == {'a': 1}",
             "assert f('frozenset') == {1, 2}", "assert f('true') == 1", "assert f('float') == 2",
             "assert f('str subclass') == 'ab'", "assert 0.5 == f('fraction')", "assert g() == 1",
             "assert f('true') == 0"]
    passed = [code_reward("", program, {"tests": [t]}) for t in tests]
    # the same asserts in one interpreter pass the first 7 (a Fraction equals 0.5); here
    # a value of a type that is not builtin fails, since it cannot leave the sandbox
    assert passed == [1.0] * 6 + [0.0, 0.0, 0.0]


def test_an_infinite_loop_times_out_to_failure_score_without_stalling():
    with code_scorer(code_time_limit_s=1.0) as s:
        t0 = time.perf_counter()
        scores, metrics = s.score([""], [fenced("while True:\n    pass")], [ADD_TESTS])
        wall = time.perf_counter() - t0
    assert scores.tolist() == [-1.0] and metrics["reward/timeouts"] == 1
    assert wall < 2.5, f"a 1 s limit took {wall:.2f} s"


@pytest.mark.parametrize("program", [
    "x = bytearray(1 << 30)\ndef add(a, b):\n    return a + b",  # 1 GiB under a 256 MiB limit
    "def add(a, b):\n    return a + b\nraise SystemExit(3)",      # exits before its tests
    "def add(a, b) return a + b",                                   # does not compile
])
def test_a_program_that_crashes_or_runs_out_of_memory_is_a_counted_failure(program):
    with code_scorer(code_memory_mb=256) as s:
        scores, metrics = s.score([""], [fenced(program)], [ADD_TESTS])
    assert scores.tolist() == [-1.0] and metrics["reward/failures"] == 1


def test_the_program_has_no_network_even_to_a_port_open_on_this_machine():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    program = fenced(f"import socket\ndef reach():\n    try:\n"
                     f"        socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
                     f"        return True\n    except OSError:\n        return False")
    meta = {"tests": ["assert reach()"]}
    try:
        unsandboxed = code_reward("", program, meta, sandbox=Unsandboxed())
        with code_scorer() as s:
            scores, _ = s.score([""], [program], [meta])
    finally:
        server.close()
    assert unsandboxed == 1.0  # the port is reachable from outside the sandbox
    assert scores.tolist() == [0.0]


REFUSED = r"""
import sys
from mcore_rl.config.sections import RewardConfig
from mcore_rl.errors import UsageError
from mcore_rl.rewards import RewardScorer
try:
    RewardScorer.from_config(RewardConfig(name="code"))
except UsageError as err:
    sys.exit(str(err))
"""


def test_the_reward_refuses_to_start_where_no_user_namespace_can_be_made():
    # a user namespace of its own whose limit of nested user namespaces is 0
    forbid = ('echo 0 > /proc/sys/user/max_user_namespaces || exit 99\n'
              'exec "$0" -c "$1"')
    try:
        done = subprocess.run(["unshare", "-r", "sh", "-c", forbid, sys.executable, REFUSED],
                              capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no unshare command")
    if done.returncode == 99 or done.stderr.startswith("unshare:"):
        pytest.skip(f"cannot make the test's own namespace: {done.stderr.strip()}")
    assert done.returncode == 1
    assert done.stderr.startswith("reward 'code' runs programs in new Linux namespaces (user, "
                                  "mount, PID, network, IPC), which this machine does not permit "
                                  "(unshare: No space left on device (the user.max_user_namespaces")
    assert "reward.sandbox=remote" in done.stderr and done.stderr.count("\n") == 1


def test_tests_in_the_wrong_format_are_an_error_naming_the_sample():
    with code_scorer() as s:
        scores, metrics = s.score(["", ""], ["pass", "pass"], [ADD_TESTS, {"tests": []}])
    assert scores.tolist() == [0.0, -1.0] and metrics["reward/errors"] == 1
    with code_scorer(max_failure_fraction=0.0) as s, \
            pytest.raises(RewardError, match=r"raised ValueError: meta\['tests'\] must be a "
                                             r"non-empty list .*\(sample 1"):
        s.score(["", ""], ["pass", "pass"], [ADD_TESTS, {"tests": []}])
