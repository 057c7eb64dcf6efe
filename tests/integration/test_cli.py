"""The `asyncgraph` console script: help, run, trace, serve, and one-line errors.

run and trace are invoked in-process with typer's CliRunner; serve is started as a real
subprocess on a free port, queried over HTTP and stopped with SIGINT, all bounded in time.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from asyncgraph.cli.main import app, error_line
from asyncgraph.errors import InputValidationError
from asyncgraph.runtime.config import ExecutorConfig

runner = CliRunner()
TIMEOUT_S = 60.0


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x) + bias
        return y, y.sum(dim=1)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = TwoInputs().eval()
    batch = torch.export.Dim("batch", min=1, max=32)
    ep = torch.export.export(
        model, (torch.randn(2, 4), torch.randn(3)), dynamic_shapes=({0: batch}, None)
    )
    path = tmp_path_factory.mktemp("models") / "two.pt2"
    torch.export.save(ep, path)
    return model, path


def invoke(*args: str) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result: Any) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("command", [[], ["run"], ["trace"], ["serve"], ["demo"]])
def test_help_everywhere(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_run_on_random_inputs_prints_the_outputs(model_file: Any) -> None:
    _, path = model_file
    result = invoke("run", path)
    assert result.exit_code == 0, result.output
    assert "2 output(s)" in result.output
    assert "output_0" in result.output and "output_1" in result.output
    assert "[2, 3]" in result.output  # the example batch of the export


@pytest.mark.parametrize("suffix", [".npy", ".pt", ".safetensors"])
def test_run_on_input_files_saves_outputs_equal_to_eager(
    model_file: Any, tmp_path: Path, suffix: str
) -> None:
    model, path = model_file
    x, bias = torch.randn(5, 4), torch.randn(3)
    if suffix == ".npy":
        np.save(tmp_path / "x.npy", x.numpy())
        np.save(tmp_path / "bias.npy", bias.numpy())
        sources = ["-i", tmp_path / "x.npy", "-i", f"bias={tmp_path / 'bias.npy'}"]
    elif suffix == ".pt":
        torch.save([x, bias], tmp_path / "inputs.pt")
        sources = ["-i", tmp_path / "inputs.pt"]
    else:
        save_file({"x": x, "bias": bias}, str(tmp_path / "inputs.safetensors"))
        sources = ["-i", tmp_path / "inputs.safetensors"]
    out = tmp_path / "out.safetensors"
    result = invoke("run", path, *sources, "-o", out, "--quiet")
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        y, total = model(x, bias)
    saved = load_file(str(out))
    torch.testing.assert_close(saved["output_0"], y)
    torch.testing.assert_close(saved["output_1"], total)

    structured = tmp_path / "out.pt"
    assert invoke("run", path, *sources, "-o", structured, "-q").exit_code == 0
    got = torch.load(structured, weights_only=True)
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got[0], y)


def test_run_errors_are_one_line(model_file: Any, tmp_path: Path) -> None:
    _, path = model_file
    line = one_error_line(invoke("run", tmp_path / "missing.pt2"))
    assert line == f"error: {tmp_path / 'missing.pt2'}: no such file"

    np.save(tmp_path / "x64.npy", np.zeros((2, 4)))  # float64, the program takes float32
    np.save(tmp_path / "bias.npy", np.zeros(3, dtype=np.float32))
    result = invoke("run", path, "-i", tmp_path / "x64.npy", "-i", tmp_path / "bias.npy")
    expected = "error: x.dtype: expected torch.float32, got torch.float64"
    assert one_error_line(result) == expected

    result = invoke("run", path, "-i", f"nope={tmp_path / 'bias.npy'}")
    assert "unknown input 'nope'; expected one of x, bias" in one_error_line(result)

    result = invoke("run", path, "-i", tmp_path / "bias.npy")
    assert "missing input(s) bias" in one_error_line(result)

    result = invoke("run", path, "-o", tmp_path / "out.npy")
    assert "holds one array and the program returns 2 outputs" in one_error_line(result)


def test_debug_shows_the_exception(tmp_path: Path) -> None:
    result = invoke("--debug", "run", tmp_path / "missing.pt2")
    assert result.exit_code != 0
    assert "no such file" in str(result.exception)
    assert type(result.exception).__name__ == "ProgramLoadError"


def test_error_line_names_the_node() -> None:
    exc = RuntimeError("shapes cannot be multiplied\nmore detail")
    exc.add_note("While executing %linear = aten.linear.default(...) [node 3]")
    assert error_line(exc) == (
        "RuntimeError: shapes cannot be multiplied "
        "(While executing %linear = aten.linear.default(...) [node 3]) [--debug for details]"
    )
    assert error_line(InputValidationError("args[0]: bad")) == "args[0]: bad"


def test_trace_command_writes_a_chrome_trace(model_file: Any, tmp_path: Path) -> None:
    _, path = model_file
    out = tmp_path / "trace.json"
    result = invoke("trace", path, "-o", out, "--executions", "6", "--concurrency", "3",
                    "--max-concurrent-executions", "1")
    assert result.exit_code == 0, result.output
    assert "6 execution(s) traced" in result.output and "aten.addmm.default" in result.output
    events = json.loads(out.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    # the 3 warm-up executions (the default --warmup) are not in the trace
    assert {e["args"]["execution"] for e in slices} == set(range(4, 10))
    assert all({"op", "inputs", "output"} <= set(e["args"]) for e in slices)
    waits = [e for e in events if e["ph"] == "b" and e["name"] == "frame wait"]
    assert len(waits) == 6


def test_serve_rejects_a_bad_model_list_in_one_line(tmp_path: Path) -> None:
    line = one_error_line(invoke("serve", "--model", "justaname"))
    assert line == "error: --model 'justaname': expected NAME=PATH"
    line = one_error_line(invoke("serve", "--model", f"m={tmp_path / 'nope.pt2'}"))
    assert line == f"error: {tmp_path / 'nope.pt2'}: no such file"
    assert one_error_line(invoke("serve")).startswith("error: no model to serve")


def test_serve_loop_option_reaches_uvicorn(
    model_file: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--loop asyncio` runs the server on asyncio (uvloop by default); a bad name or --loop
    with --ray is refused in one line, before anything is loaded."""
    import asyncgraph.serve

    _, path = model_file
    loops: list[str] = []

    def fake_run(app: Any, host: str, port: int, **options: Any) -> None:
        loops.append(options["loop"])

    monkeypatch.setattr(asyncgraph.serve, "run", fake_run)
    for flags, expected in (([], "uvloop"), (["--loop", "asyncio"], "asyncio")):
        result = invoke("serve", path, "--port", "0", *flags)  # it binds before `run`
        assert result.exit_code == 0, result.output
        assert loops.pop() == expected
    result = invoke("serve", path, "--loop", "trio")
    assert result.exit_code != 0 and "expected one of uvloop, asyncio" in result.output
    line = one_error_line(invoke("serve", path, "--ray", "--loop", "asyncio"))
    assert line == "error: --loop applies to the local server; Ray Serve runs its own"
    assert loops == []


def test_serve_worker_priority_reaches_the_executors(
    model_file: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--worker-nice`, `--worker-idle` and `--worker-yield-s` set ExecutorConfig's
    worker_nice, worker_idle and worker_yield_s; left out, they are the config's defaults."""
    import asyncgraph.serve
    from asyncgraph.cli import serve as serve_cli

    _, path = model_file
    nices: list[tuple[bool, int, float]] = []
    load = serve_cli.load_executor

    def recording_load(model: Path, config: ExecutorConfig, trust_compiled: bool) -> Any:
        nices.append((config.worker_idle, config.worker_nice, config.worker_yield_s))
        return load(model, config, trust_compiled)

    monkeypatch.setattr(serve_cli, "load_executor", recording_load)
    monkeypatch.setattr(asyncgraph.serve, "run", lambda *args, **options: None)
    for flags in ([], ["--worker-idle"], ["--worker-nice", "0"], ["--worker-yield-s", "0"]):
        result = invoke("serve", path, "--port", "0", *flags)
        assert result.exit_code == 0, result.output
    default = ExecutorConfig()
    idle, nice, yield_s = default.worker_idle, default.worker_nice, default.worker_yield_s
    assert nices == [(idle, nice, yield_s), (True, nice, yield_s), (idle, 0, yield_s),
                     (idle, nice, 0.0)]
    result = invoke("serve", path, "--port", "0", "--worker-nice", "-1")
    assert result.exit_code != 0


def _read_lines(stream: Any, into: queue.Queue[str]) -> None:
    for line in iter(stream.readline, ""):
        into.put(line)


def test_serve_command_serves_until_interrupted(model_file: Any) -> None:
    model, path = model_file
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncgraph.cli.main", "serve", str(path), "--name", "two",
         "--model", f"again={path}", "--port", "0", "--max-queue", "4", "--pin-workers"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        url = None
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url is not None, "".join(seen)
        x, bias = torch.randn(2, 4), torch.randn(3)
        body = {"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": x.reshape(-1).tolist()},
            {"name": "bias", "datatype": "FP32", "shape": [3], "data": bias.tolist()},
        ]}
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
            assert client.get("/v2/health/ready").status_code == 200
            assert client.get("/v2/models/again/ready").status_code == 200
            meta = client.get("/v2/models/two").json()
            assert [o["name"] for o in meta["outputs"]] == ["output_0", "output_1"]
            r = client.post("/v2/models/two/infer", json=body)
            assert r.status_code == 200, r.text
        with torch.no_grad():
            y, _ = model(x, bias)
        got = torch.tensor(r.json()["outputs"][0]["data"]).reshape(2, 3)
        torch.testing.assert_close(got, y)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)
        reader.join(timeout=TIMEOUT_S)
        assert proc.stdout is not None
        proc.stdout.close()
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen)
    assert "Finished server process" in output and "server stopped" in output, output
    assert "Traceback" not in output, output


def test_serve_with_batching_refuses_a_model_that_cannot_batch_in_one_line(
    model_file: Any,
) -> None:
    _, path = model_file  # its second input, the bias, has no batch dimension
    line = one_error_line(invoke("serve", str(path), "--max-batch-size", "8"))
    assert line.startswith("error: batching needs dim 0 of every tensor input")
    assert "'bias'" in line and "[3]" in line


# -- the intra-op thread policy (ExecutorConfig.intra_op_threads, --threads) -------------------


def _threads_seen_by_a_worker_kernel() -> tuple[Any, list[int]]:
    """A graph whose one node runs on a worker and records torch's thread count there."""
    from asyncgraph import GraphBuilder

    seen: list[int] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return x + 1

    b = GraphBuilder()
    b.output(b.call(record, b.input("x"), name="record", placement="worker"))
    return b.build(), seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("threads", "parallel_ops", "expected"), [(3, 1, 3), (None, 64, 1)])
async def test_intra_op_threads_reach_the_worker_kernels(
    leak_check: Any, threads: int | None, parallel_ops: int, expected: int
) -> None:
    from asyncgraph import Executor, ExecutorConfig

    graph, seen = _threads_seen_by_a_worker_kernel()
    config = ExecutorConfig(intra_op_threads=threads, max_parallel_ops=parallel_ops)
    assert config.intra_op_threads_or_default == expected
    async with Executor(graph, config) as ex:
        await ex.execute(torch.zeros(2))
    assert seen == [expected]  # None: CPUs / 64 workers, at least 1


def test_intra_op_threads_must_be_positive() -> None:
    from asyncgraph import ExecutorConfig

    with pytest.raises(ValueError, match="intra_op_threads must be >= 1"):
        ExecutorConfig(intra_op_threads=0)


@pytest.fixture
def made_configs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every ExecutorConfig an Executor is made with during the test, and the torch thread
    count of the thread that made it; torch's count is restored afterwards."""
    from asyncgraph.runtime.executor import Executor

    made: list[tuple[Any, int]] = []
    original = Executor.__init__

    def recording_init(self: Any, program: Any, config: Any = None, **kwargs: Any) -> None:
        made.append((config, torch.get_num_threads()))
        original(self, program, config, **kwargs)

    monkeypatch.setattr(Executor, "__init__", recording_init)
    before = torch.get_num_threads()
    yield made
    torch.set_num_threads(before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "command",
    [
        ["demo", "--executions", "4", "--concurrency", "2"],
        ["run", "{model}", "-q"],
        ["trace", "{model}", "-o", "{tmp}/t.json", "--executions", "2"],
        ["stress", "{model}", "--executions", "6", "--concurrency", "2"],
        ["check", "{model}"],
        ["profile", "{model}", "--runs", "1", "--warmup", "0"],
    ],
)
def test_threads_option_reaches_the_config_and_torch(
    command: list[str], model_file: Any, tmp_path: Path, made_configs: Any
) -> None:
    _, path = model_file
    args = [a.format(model=path, tmp=tmp_path) for a in command]
    result = invoke(*args, "--threads", "3")
    assert result.exit_code == 0, result.output
    assert made_configs, "the command made no Executor"
    for config, torch_threads in made_configs:
        assert config.intra_op_threads == 3
        assert torch_threads == 3  # the command's own thread, the one running the loop


def test_every_command_that_runs_models_takes_threads() -> None:
    for command in ("demo", "run", "trace", "serve", "stress", "check", "profile", "bench"):
        result = invoke(command, "--help")
        assert result.exit_code == 0, result.output
        assert "--threads" in result.output, command


@pytest.mark.parametrize("command", ["trace", "run"])
def test_output_path_is_checked_before_the_run(
    command: str, model_file: Any, tmp_path: Path, made_configs: Any
) -> None:
    _, path = model_file
    line = one_error_line(invoke(command, path, "-o", tmp_path))
    assert line == f"error: {tmp_path}: is a directory; give a file name"
    missing = tmp_path / "nope" / "out.json"
    line = one_error_line(invoke(command, path, "-o", missing))
    assert line == f"error: {missing}: no such directory {missing.parent}"
    assert made_configs == []  # refused before the model was loaded


def test_trace_warmup_zero_traces_the_cold_calls(model_file: Any, tmp_path: Path) -> None:
    _, path = model_file
    out = tmp_path / "trace.json"
    result = invoke("trace", path, "-o", out, "--executions", "2", "--warmup", "0")
    assert result.exit_code == 0, result.output
    slices = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["execution"] for e in slices} == {1, 2}


# -- one way to fail: `error: ...` on stderr, exit status 1 ------------------------------------

_MODEL_COMMANDS = ["run", "trace", "stress", "check", "profile", "serve"]


@pytest.mark.parametrize("command", _MODEL_COMMANDS)
def test_a_missing_model_file_is_one_error_line(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt2"
    assert one_error_line(invoke(command, missing)) == f"error: {missing}: no such file"


@pytest.mark.parametrize("command", _MODEL_COMMANDS)
def test_a_directory_given_as_model_is_named_a_directory(command: str, tmp_path: Path) -> None:
    line = one_error_line(invoke(command, tmp_path))
    assert line == f"error: {tmp_path}: is a directory, not a .pt2 file"


def test_a_directory_given_as_input_is_named_a_directory(model_file: Any, tmp_path: Path) -> None:
    _, path = model_file
    folder = tmp_path / "x.npy"
    folder.mkdir()
    line = one_error_line(invoke("run", path, "-i", folder))
    assert line == f"error: {folder}: is a directory, not a tensor file"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--loop", "nope"], "Invalid value for --loop: expected one of asyncio"),
        (["run"], "Missing argument 'MODEL'"),
        (["check", "{model}", "--rtol", "0.1"], "give both --rtol and --atol, or neither"),
    ],
)
def test_usage_errors_are_one_error_line(
    args: list[str], message: str, model_file: Any
) -> None:
    _, path = model_file
    line = one_error_line(invoke(*[a.format(model=path) for a in args]))
    assert message in line and f"(see 'asyncgraph {args[0]} --help')" in line


@pytest.mark.parametrize(
    "command", [[], ["demo"], ["run"], ["trace"], ["serve"], ["stress"], ["check"],
                ["profile"], ["bench"]],
)
def test_help_has_plain_usage_and_flags_without_a_type(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    usage = next(line for line in result.output.splitlines() if "Usage:" in line)
    assert "{" not in usage and "<" not in usage, usage
    if command and command[0] in _MODEL_COMMANDS:
        assert "MODEL" in usage, usage
    assert "<bool>" not in result.output


# -- issue #37: --debug after the command, --version, check -i, the CLI's import cost ---------

_ALL_COMMANDS = ["bench", "check", "compile", "demo", "profile", "run", "serve", "stress",
                 "trace"]


def test_every_command_is_listed() -> None:
    from typer.main import get_command

    assert sorted(get_command(app).commands) == _ALL_COMMANDS  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", _ALL_COMMANDS)
def test_debug_is_taken_after_every_command(command: str) -> None:
    result = invoke(command, "--debug", "--help")
    assert result.exit_code == 0, result.output
    assert "--debug" in result.output and "Show full" in result.output


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_after_the_command_shows_the_exception(where: str, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pt2"
    args = ["--debug", "run", missing] if where == "before" else ["run", missing, "--debug"]
    result = invoke(*args)
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "ProgramLoadError"
    assert "no such file" in str(result.exception)
    # without it: one line
    assert one_error_line(invoke("run", missing)) == f"error: {missing}: no such file"


@pytest.mark.parametrize(
    ("args", "command"),
    [(["run", "x.pt2", "--bogus"], "asyncgraph run"), (["--bogus"], "asyncgraph"),
     (["nope"], "asyncgraph")],
)
def test_unknown_options_and_commands_are_one_error_line(args: list[str], command: str) -> None:
    line = one_error_line(invoke(*args))
    assert f"(see '{command} --help')" in line, line


def test_version_names_asyncgraph_and_torch() -> None:
    from importlib import metadata

    result = invoke("--version")
    assert result.exit_code == 0, result.output
    ours, installed = metadata.version("asyncgraph"), metadata.version("torch")
    assert result.output.strip() == f"asyncgraph {ours} (torch {installed})"
    # The metadata names the torch that runs; a build's local tag (+cpu, +cu130) may be
    # in torch.__version__ only, as PyPI's CUDA wheels have it.
    assert installed.split("+")[0] == str(torch.__version__).split("+")[0]


def test_help_and_version_do_not_import_torch() -> None:
    """The console script's own import cost: `asyncgraph --help`, `--version` and every
    command's --help run without importing torch (a fresh interpreter: this one has it)."""
    runs = [["--help"], ["--version"], *([c, "--help"] for c in _ALL_COMMANDS)]
    code = textwrap.dedent(f"""
        import json, sys
        from asyncgraph.cli.main import main
        seen = []
        for args in {runs!r}:
            sys.argv = ["asyncgraph", *args]
            try:
                main()
            except SystemExit as exc:
                code = exc.code
            seen.append([args, code, "torch" in sys.modules])
        print("RESULT " + json.dumps(seen))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.rpartition("RESULT ")[2])
    assert [(args, code) for args, code, _ in seen] == [(args, 0) for args in runs]
    assert [args for args, _, imported in seen if imported] == []


def test_check_runs_on_input_files(model_file: Any, tmp_path: Path) -> None:
    _, path = model_file
    inputs = tmp_path / "inputs.safetensors"
    save_file({"x": torch.randn(5, 4), "bias": torch.randn(3)}, str(inputs))
    result = invoke("check", path, "-i", inputs)
    assert result.exit_code == 0, result.output
    assert "on inputs from inputs.safetensors" in result.output
    assert "[5, 3]" in result.output  # the rows of the file, not the example's 2

    np.save(tmp_path / "x64.npy", np.zeros((2, 4)))  # float64, the program takes float32
    np.save(tmp_path / "bias.npy", np.zeros(3, dtype=np.float32))
    result = invoke("check", path, "-i", tmp_path / "x64.npy", "-i", tmp_path / "bias.npy")
    assert "dtype: expected torch.float32, got torch.float64" in one_error_line(result)
    result = invoke("check", path, "-i", f"nope={tmp_path / 'bias.npy'}")
    assert "unknown input 'nope'; expected one of x, bias" in one_error_line(result)
    result = invoke("check", path, "-i", inputs, "--random")
    assert "give input files or --random, not both" in one_error_line(result)


def test_a_bare_asyncgraph_shows_the_help() -> None:
    result = invoke()
    assert "Usage" in result.output and "error:" not in result.output
