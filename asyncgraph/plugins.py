"""What the layers above the runtime give it: the tracer and the scripted-segments pass.

The runtime defines the hooks (runtime/instrument.py, runtime/extensions.py) and never imports
what plugs into them; this module, run by `import asyncgraph`, plugs in tools/trace.py's
TraceRecorder (ExecutorConfig.trace) and compiled/scripted.py's `script_segments`
(ExecutorConfig.script_segments, imported when an Executor first asks for it: torch.jit on
demand).
"""

from __future__ import annotations

from asyncgraph.runtime.extensions import GraphPass, register_pass
from asyncgraph.runtime.instrument import register_tracer
from asyncgraph.tools.trace import TraceRecorder


def _script_segments() -> GraphPass:
    from asyncgraph.compiled.scripted import script_segments  # torch.jit on demand

    return script_segments


register_tracer(TraceRecorder)
register_pass("script_segments", _script_segments)
