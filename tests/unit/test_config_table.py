"""The range tables of BatchingConfig, CudaConfig and ExecutorConfig
(asyncgraph/runtime/config.py).

Every Range rejects a value just out of its range with a message that names its field and
accepts its boundary; the rules run in table order, so of two bad fields the earlier one is
reported; and the messages keep the text that callers and other tests match.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from asyncgraph.runtime.config import (
    BATCHING_RULES,
    CUDA_RULES,
    EXECUTOR_RULES,
    BatchingConfig,
    CudaConfig,
    ExecutorConfig,
    Range,
)

RANGES: list[tuple[type[Any], Range]] = [
    (config, rule)
    for config, rules in (
        (BatchingConfig, BATCHING_RULES), (CudaConfig, CUDA_RULES), (ExecutorConfig, EXECUTOR_RULES)
    )
    for rule in rules
    if isinstance(rule, Range)
]


def _id(case: tuple[type[Any], Range]) -> str:
    return f"{case[0].__name__}.{case[1].name}"


def _just_out(rule: Range) -> float:
    return rule.bound - 1 if rule.op == ">=" else rule.bound


def _boundary(rule: Range) -> float:
    return rule.bound if rule.op == ">=" else rule.bound + 0.001


@pytest.mark.parametrize("case", RANGES, ids=_id)
def test_range_rejects_just_out_of_range(case: tuple[type[Any], Range]) -> None:
    config, rule = case
    value = _just_out(rule)
    with pytest.raises(ValueError, match=rf"^{rule.name} must be {re.escape(rule.op)} ") as err:
        config(**{rule.name: value})
    assert str(err.value) == rule.message(value)
    assert str(err.value).endswith(f", got {value}")


@pytest.mark.parametrize("case", RANGES, ids=_id)
def test_range_accepts_its_boundary(case: tuple[type[Any], Range]) -> None:
    config, rule = case
    made = config(**{rule.name: _boundary(rule)})
    assert getattr(made, rule.name) == _boundary(rule)
    if rule.or_none:
        assert getattr(config(**{rule.name: None}), rule.name) is None


@pytest.mark.parametrize("case", RANGES, ids=_id)
def test_range_names_a_field_of_its_config(case: tuple[type[Any], Range]) -> None:
    config, rule = case
    assert rule.name in {f.name for f in dataclasses.fields(config)}


def test_rules_run_in_table_order() -> None:
    # min_frames (a rule in code) sits between max_frame_waiters and frame_cleanup_interval_s
    with pytest.raises(ValueError, match=r"^max_frame_waiters must be >= 0"):
        ExecutorConfig(max_frame_waiters=-1, min_frames=-1, heavy_op_flops=-1)
    with pytest.raises(ValueError, match=r"^min_frames must be between 0"):
        ExecutorConfig(min_frames=-1, frame_cleanup_interval_s=-1, heavy_op_flops=-1)
    with pytest.raises(ValueError, match=r"^max_batch_size must be >= 1"):
        BatchingConfig(max_batch_size=0, max_queued_requests=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be >= 1, got 0"),
        ({"loop_slice_s": 0.0}, "loop_slice_s must be > 0, got 0.0"),
        (
            {"intra_op_threads": 0},
            "intra_op_threads must be >= 1 or None (CPUs / max_parallel_ops), got 0",
        ),
        (
            {"worker_execution_node_us": -1.5},
            "worker_execution_node_us must be >= 0 or None, got -1.5",
        ),
        (
            {"streams": 0},
            "streams must be >= 1 or None (CUDA streams per device for one execution), got 0",
        ),
        (
            {"graph_warmup": -1},
            "graph_warmup must be >= 0 (executions of a signature before its capture), got -1",
        ),
        (
            {"max_concurrent_executions": 2, "min_frames": 3},
            "min_frames must be between 0 and max_concurrent_executions (2), got 3",
        ),
    ],
)
def test_messages_keep_their_text(kwargs: dict[str, Any], message: str) -> None:
    config = (
        BatchingConfig if "max_batch_size" in kwargs
        else CudaConfig if kwargs.keys() & {"streams", "graph_warmup"}
        else ExecutorConfig
    )
    with pytest.raises(ValueError) as err:
        config(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ("onnx", "segments must be a tuple of segment backend names, e.g. ('onnx',), got 'onnx'"),
        (("onnx", ""), "segments must be a tuple of segment backend names, e.g. ('onnx',), "
                       "got ('onnx', '')"),
        (("onnx", "onnx"), "segments must name each backend once, got ('onnx', 'onnx')"),
    ],
)
def test_segments_names_each_backend_once(segments: Any, message: str) -> None:
    """A bare string would be planned letter by letter: refused, as a backend named twice."""
    with pytest.raises(ValueError) as err:
        ExecutorConfig(segments=segments)
    assert str(err.value) == message


def test_segments_as_a_list_is_kept_as_a_tuple() -> None:
    config = ExecutorConfig(segments=["script", "onnx"])  # type: ignore[arg-type]
    assert config.segments == ("script", "onnx")
    assert dataclasses.replace(config, max_parallel_ops=1).segments == ("script", "onnx")
