"""`asyncgraph serve` shows asyncgraph's own log lines beside uvicorn's (serve/runner.py)."""

from __future__ import annotations

import io
import logging
import logging.config
from collections.abc import Iterator

import pytest

from asyncgraph.serve.runner import log_config


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """dictConfig changes process-wide loggers: put back what the other tests rely on."""
    names = ("asyncgraph", "asyncgraph.serve", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = {
        name: (lg.handlers[:], lg.level, lg.propagate, lg.disabled)
        for name in names for lg in [logging.getLogger(name)]
    }
    yield
    for name, (handlers, level, propagate, disabled) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate
        lg.disabled = disabled


def _apply(level: str) -> io.StringIO:
    config = log_config(level)
    stream = io.StringIO()
    config["handlers"]["default"]["stream"] = stream  # what uvicorn writes to stderr
    logging.config.dictConfig(config)
    return stream


@pytest.mark.usefixtures("restored_logging")
def test_serve_logging_shows_asyncgraph_info_lines_on_uvicorns_handler() -> None:
    """Before, the calibration's INFO line under `asyncgraph serve` went nowhere: the
    asyncgraph loggers had no handler, and Python's last resort shows warnings only."""
    stream = _apply("info")
    logging.getLogger("asyncgraph.serve").info("model 'm' calibrated")
    assert "model 'm' calibrated" in stream.getvalue()
    assert "INFO" in stream.getvalue()


@pytest.mark.usefixtures("restored_logging")
def test_serve_log_level_applies_to_asyncgraph_lines() -> None:
    stream = _apply("warning")
    logging.getLogger("asyncgraph.serve").info("hidden")
    logging.getLogger("asyncgraph.serve").warning("shown")
    assert "hidden" not in stream.getvalue()
    assert "shown" in stream.getvalue()


def test_serve_log_config_leaves_uvicorns_own_config_unchanged() -> None:
    import uvicorn.config

    log_config("debug")
    assert "asyncgraph" not in uvicorn.config.LOGGING_CONFIG["loggers"]
