"""Weights: the parameters, buffers and constants of a program, versioned and immutable.

A swap builds a new Weights object and replaces the Executor's reference in one assignment.
An execution reads the Weights it found when its frame was checked out, so it finishes on the
weights it started with, and no execution ever sees a mix of two versions. An asynchronous
swap comes in two halves: a PreparedWeights (checked and folded off the loop, seen by nothing)
and its commit (that one assignment), so a caller can put several Executors' new weights in
place in one step of the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from asyncgraph.errors import WeightsError


class Weights:
    """One immutable version of a program's named weights."""

    __slots__ = ("_template", "derived", "tensors", "version")

    def __init__(
        self,
        tensors: Mapping[str, Any],
        version: int = 0,
        derived: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, Any] = dict(tensors)
        self.version = version
        # values computed from the tensors (folded constants, asyncgraph/passes/folding.py): in the
        # template, but not weights a caller can swap
        self.derived: dict[str, Any] = dict(derived or {})
        self._template: list[Any] | None = None

    def template(self, slots: tuple[tuple[int, str], ...], num_values: int) -> list[Any]:
        """A frame's value list holding these weights in their slots (built once)."""
        if self._template is None:
            template: list[Any] = [None] * num_values
            for slot, name in slots:
                template[slot] = (
                    self.tensors[name] if name in self.tensors else self.derived[name]
                )
            self._template = template
        return self._template

    def with_derived(self, derived: Mapping[str, Any]) -> Weights:
        """This version with `derived` values (computed from these tensors)."""
        return Weights(self.tensors, self.version, derived)

    def swapped(self, state_dict: Mapping[str, Any], *, strict: bool = False) -> Weights:
        """A new version with `state_dict` replacing the named weights, checked first."""
        unknown = sorted(set(state_dict) - set(self.tensors))
        if unknown:
            raise WeightsError(f"unknown weight name(s): {', '.join(unknown)}")
        if strict:
            missing = sorted(set(self.tensors) - set(state_dict))
            if missing:
                raise WeightsError(f"missing weight(s) in a strict swap: {', '.join(missing)}")
        for name, new in state_dict.items():
            old = self.tensors[name]
            if isinstance(old, torch.Tensor):
                if not isinstance(new, torch.Tensor):
                    raise WeightsError(f"{name}: expected a Tensor, got {type(new).__name__}")
                if new.shape != old.shape:
                    raise WeightsError(
                        f"{name}.shape: expected {tuple(old.shape)}, got {tuple(new.shape)}"
                    )
                if new.dtype != old.dtype:
                    raise WeightsError(f"{name}.dtype: expected {old.dtype}, got {new.dtype}")
                if new.device != old.device:
                    raise WeightsError(f"{name}.device: expected {old.device}, got {new.device}")
        return Weights({**self.tensors, **state_dict}, self.version + 1)  # derived: recompute

    def updated(self, state_dict: Mapping[str, Any]) -> Weights:
        """A new version with `state_dict` replacing the named weights, unchecked; the derived
        values carry over (buffer updates from executions: folded values never read those)."""
        return Weights({**self.tensors, **state_dict}, self.version + 1, self.derived)

    def __repr__(self) -> str:
        return f"<Weights version={self.version}: {len(self.tensors)} tensors>"


_RAN_ON: ContextVar[int | None] = ContextVar("asyncgraph_weights_ran_on", default=None)


def weights_ran_on() -> int | None:
    """The weights version the calling task's latest execution ran on (None before its first),
    read right after `execute` returns.

    Why: an execution takes the weights current when it starts, not when its caller chose the
    Executor. A server that labels an answer with a model version (serve/model_control.py)
    labels it by the weights that made it: a hot swap may come between the request's lookup
    and its execution's start."""
    return _RAN_ON.get()


def ran_on(version: int) -> None:
    """Note, in the calling task, the weights version its execution runs on (the Executor
    and the batcher call it)."""
    _RAN_ON.set(version)


@dataclass(frozen=True, slots=True)
class PreparedWeights:
    """A weights swap made ready by `Executor.prepare_weights` (names and shapes checked,
    constants folded on a thread) that no execution sees until `Executor.commit_weights` puts
    it in place. `base` is the version it was folded from: when the weights that folding reads
    have changed since, the commit folds again."""

    owner: object  # the Executor that prepared it: only that one may commit it
    state_dict: Mapping[str, Any]
    strict: bool
    base: Weights
    derived: Mapping[str, Any] | None  # the new version's folded constants; None: none to fold
