"""The runtime: one Executor, and the WorkUnit loop that runs each execution as a dataflow.

Read in this order:
- `executor`, `config`: the public face (execute, swap_weights, statistics, aclose) and its
  settings; `build`: an Executor's construction as a pipeline (passes, kernels, plan, device
  plans); `validation` checks a call's inputs before anything is taken; `weights` holds the
  versioned, immutable weights.
- `pool`, `gate`, `frame`: the bounded async pool of ExecutionFrames, whose waiters queue in
  the first-come-first-served hand-off that serving's admission shares; a frame holds
  everything one execution owns, so no per-execution state lives anywhere else.
- `plan`, `placement`, `schedule`: built once, or once per input-shape signature: where each
  node runs (inline on the loop, on a worker thread, as a task, on a CUDA stream) and the units
  an execution runs, with their producer counts.
- `scheduler`: the WorkUnit loop itself: run a unit, free values, decrement users' counts,
  continue with the ready ones that run here, hand off the rest; `straight`: an all-inline
  schedule's units in order, without the dataflow; `loop_state`, `failures`: what the two
  share (the loop, its budget and load; how an execution fails).
- `workers`, `loop_budget`: the CPU threads for heavy kernels, and the per-iteration slice
  that inline work on the event loop shares fairly.
- `batching`: dynamic batching of concurrent requests into one execution.
- `backend` (and `backends/`): the event-loop seam, asyncio (uvloop) or trio.
- `registry`: every live Executor, read by the leak checker without the runtime importing it.
"""
