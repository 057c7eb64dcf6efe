"""The pytest plugin users adopt: `pytest_plugins = ["asyncgraph.testing.pytest_plugin"]`."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = '''
import asyncio
import pytest
from asyncgraph import Executor, ExecutorConfig, GraphBuilder

def graph():
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(lambda v: v + 1, x, name="inc", placement="worker"))
    return b.build()

async def test_clean(asyncgraph_leak_check):
    async with Executor(graph()) as ex:
        assert await ex.execute(1) == 2

async def test_leaks_a_frame(asyncgraph_leak_check, fault_injector):
    fault_injector.delay("inc", seconds=1.0)  # the frame is still in use when the test ends
    ex = Executor(graph(), ExecutorConfig(), kernel_factory=fault_injector.kernel_factory())
    task = asyncio.create_task(ex.execute(1))
    await asyncio.sleep(0.01)

async def test_faults(fault_injector):
    fault_injector.raise_on("inc", calls={0})
    async with Executor(graph(), kernel_factory=fault_injector.kernel_factory()) as ex:
        with pytest.raises(RuntimeError, match="injected fault"):
            await ex.execute(1)
        assert await ex.execute(1) == 2
'''


def test_plugin_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["asyncgraph.testing.pytest_plugin"]\n')
    pytester.makeini(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(test_user=USER_TESTS)
    # Without hypothesis's plugin: its summary hook imports hypothesis when no test did, and
    # with the outer conftest's gc.freeze() on (it unfreezes only at its own session's end)
    # hypothesis warns about trio's PRNG, an error under filterwarnings, which broke the
    # summary this test parses whenever no earlier test in the process imported hypothesis.
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-q"
    )
    result.assert_outcomes(passed=3, errors=1)  # the leaky test passes, its teardown fails
    result.stdout.fnmatch_lines(
        ["*LeakError: leak check failed:*", "*1 frame(s) still in use*"]
    )
