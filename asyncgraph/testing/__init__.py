"""Tools for testing code that uses asyncgraph, and asyncgraph itself.

- LeakChecker: after a block, no frame in use, no waiter, no pending task, no stray worker
  thread, no CUDA memory growth. As a pytest fixture: `pytest_plugins =
  ["asyncgraph.testing.pytest_plugin"]` gives `asyncgraph_leak_check`.
- FaultInjector: kernels that raise, sleep or block (Gate) on chosen nodes or at random.
- ReferenceRunner: the serial, node-by-node reference to check results against.
- run_stress / StressConfig / StressReport: the stress harness behind `asyncgraph stress`.
- LoopLagMonitor: a 1 ms heartbeat that measures event-loop lag.
- `asyncgraph.testing.introspect` (not re-exported here): read-only white-box views of an
  Executor (idle frames, schedules) for asyncgraph's own tests.
"""

from asyncgraph.testing.faults import (
    FaultEvent,
    FaultInjectingKernelFactory,
    FaultInjectionError,
    FaultInjector,
    FaultRule,
    Gate,
    InjectedFault,
)
from asyncgraph.testing.leaks import LeakChecker, LeakError
from asyncgraph.testing.reference import ReferenceRunner, perturbed_weights, random_inputs
from asyncgraph.testing.stress import LoopLagMonitor, StressConfig, StressReport, run_stress

__all__ = [
    "FaultEvent",
    "FaultInjectingKernelFactory",
    "FaultInjectionError",
    "FaultInjector",
    "FaultRule",
    "Gate",
    "InjectedFault",
    "LeakChecker",
    "LeakError",
    "LoopLagMonitor",
    "ReferenceRunner",
    "StressConfig",
    "StressReport",
    "perturbed_weights",
    "random_inputs",
    "run_stress",
]
