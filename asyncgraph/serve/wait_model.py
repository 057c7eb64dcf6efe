"""The wait model: what a request admitted now is expected to wait, from running means.

The admission gate (admission.py) decides whether to take a request by the time it expects the
request to wait. This module is that arithmetic alone, with no awaiting and no refusing: the
means it learns, the rates they give, and the expected waits. The gate keeps the counts it
reads (slots running, requests pending and their bytes) and feeds it what it measures.

**The means.** Exponentially weighted (`SERVICE_EWMA_WEIGHT`): a request's decode and encode
time and, when decodes queue for the gate's decode lane, the interval from one decode's end
to the next one's, shared by the requests that arrived in it: the loop time each request ahead
really costs the ones behind it, body reads, refusals and completions in between included
(decode + encode alone counted 70-80% of it under overload with 253 KB JSON bodies). Shared,
because a burst's arrivals are read in a few long loop turns (each request once), while a lane
hand-off takes a loop turn of its own: unshared, the first hand-offs of a burst of small
requests counted 11 ms each and refused requests that the server answered in under 100 ms.
The longer of the two is the loop time per request (`loop_s`). And the mean time a request
holds a slot: the slots' rate is capacity / that mean (Little's law with every slot busy).

**The expected wait.** A new request waits for the decodes ahead of it (requests admitted and
not yet decoded, each one loop time per request) and for a slot (those ahead beyond the free
slots, at the slots' rate); the two stages overlap, so it expects to wait the longer of the
two (`wait_s`), then to execute one mean slot time. The gate refuses it when that passes the
time left to its deadline.

**Calibration.** When the app starts, before it takes traffic, it times a representative
request of each model (calibration.py: random inputs of the example shapes as a JSON body;
decode, one execution, encode) and seeds the means with it (`calibrate`): the gate predicts
from the first request on, and live measurements take over through the running means. A
decode is priced by the body's size (`decode_s`: the mean decode time per byte, calibrated and
then measured on every decode of a known size, times its Content-Length; the requests ahead at
the mean size of the bodies admitted and not yet running), so a larger body of the same model
costs in proportion. Uncalibrated, nothing is `measured` before the first completion, and the
model predicts no wait at all (what the gate does then is its own policy: `first_burst`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The weight of the newest service time in the running mean: about the last 10 requests
#: count, so the estimate follows a change of load within a few dozen requests without
#: swinging on one slow request.
SERVICE_EWMA_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class Calibration:
    """What one representative request cost when the server started (see the module
    docstring): its body's size, and the seconds its decode, its execution and its response's
    encode took (the median of `rounds` timed rounds)."""

    body_bytes: int
    decode_s: float
    execute_s: float
    encode_s: float
    rounds: int

    @property
    def decode_s_per_byte(self) -> float:
        return self.decode_s / max(self.body_bytes, 1)


def _ewma(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + SERVICE_EWMA_WEIGHT * (sample - mean)


class WaitModel:
    """The running means of one model's requests and the waits they predict (see the module
    docstring).

    The gate is a WaitModel (admission.py's Admission subclasses it), so the means stay
    readable where metrics, tests and the app read them (`admission.mean_service_s`). It
    keeps the counts read here up to date: `running` slots taken, `pending` requests admitted
    and not yet running with `pending_priced_bytes` (their bodies' sizes as priced), and
    `arrived` (requests that reached it, admitted or refused)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.running = 0
        self.pending = 0
        #: the pending bodies' sizes as priced: declared (Content-Length) or arrived, larger
        self.pending_priced_bytes = 0
        self.arrived = 0
        self.completed = 0
        self.mean_service_s: float | None = None
        self.mean_decode_s: float | None = None
        self.mean_encode_s: float | None = None
        self.mean_turn_s: float | None = None  # decode end to decode end, when they queue
        self.mean_decode_s_per_byte: float | None = None  # decodes of a known body size
        self.calibration: Calibration | None = None
        self._lane_free_at: float | None = None
        self._arrived_at_lane_free = 0

    @property
    def measured(self) -> bool:
        """The gate has a service time to predict with: it was calibrated at start-up, or a
        request has completed."""
        return self.mean_service_s is not None

    def calibrate(self, calibration: Calibration) -> None:
        """Seed the means with what a representative request cost at start-up, so the gate
        predicts from the first request on; live measurements take over through the running
        means."""
        self.calibration = calibration
        self.mean_decode_s = calibration.decode_s
        self.mean_decode_s_per_byte = calibration.decode_s_per_byte
        self.mean_encode_s = calibration.encode_s
        self.mean_service_s = calibration.execute_s

    # -- what a request costs ---------------------------------------------------------------

    def decode_s(self, nbytes: int) -> float:
        """Seconds a body of `nbytes` is expected to take to decode: priced by its size once a
        decode of a known size was measured (or calibrated), else the mean decode."""
        per_byte = self.mean_decode_s_per_byte
        if per_byte is not None and nbytes > 0:
            return per_byte * nbytes
        return self.mean_decode_s or 0.0

    def loop_s_for(self, nbytes: int) -> float:
        """Seconds of event loop a request with a body of `nbytes` costs outside its slot:
        its decode + encode, or, once decodes have queued for the lane, the interval from one
        decode's end to the next one's (which also counts the body reads, refusals and
        completions in between), whichever is longer."""
        own = self.decode_s(nbytes) + (self.mean_encode_s or 0.0)
        return max(own, self.mean_turn_s or 0.0)

    @property
    def loop_s(self) -> float:
        """Mean seconds of event loop a request costs outside its slot (`loop_s_for` of the
        mean decode, whatever its size)."""
        return self.loop_s_for(0)

    def _loop_s_ahead(self) -> float:
        """The loop time of each request ahead: priced at the mean size of the bodies
        admitted and not yet running."""
        return self.loop_s_for(self.pending_priced_bytes // self.pending if self.pending else 0)

    # -- rates and waits --------------------------------------------------------------------

    @property
    def slot_rate(self) -> float | None:
        """Requests per second the slots serve when all are busy; None before a completion."""
        mean = self.mean_service_s
        return None if mean is None else self.capacity / max(mean, 1e-9)

    @property
    def service_rate(self) -> float | None:
        """Requests per second the gate serves when loaded: the slower of the slots and the
        loop's decode + encode; None before the first completion."""
        rate = self.slot_rate
        if rate is None or self.loop_s <= 0.0:
            return rate
        return min(rate, 1.0 / self.loop_s)

    def expected_wait_s(self, ahead: int) -> float:
        """Seconds a request expects to wait for a slot behind `ahead` others (0 when a slot
        will be free for it, or before anything is measured)."""
        rate = self.slot_rate
        behind_free = ahead - (self.capacity - self.running)
        if rate is None or behind_free < 0:
            return 0.0
        return (behind_free + 1) / rate

    def lane_wait_s(self, to_decode: int, nbytes: int = 0) -> float:
        """Seconds of loop a request of `nbytes` expects before its own decode and encode are
        done, behind `to_decode` requests not yet decoded (each one loop time at the mean
        size of the bodies ahead)."""
        return to_decode * self._loop_s_ahead() + self.loop_s_for(nbytes)

    def wait_s(self, ahead: int, to_decode: int = 0, nbytes: int = 0) -> float:
        """Seconds a request of `nbytes` expects to wait behind `ahead` others for a slot and
        behind `to_decode` for the loop: the two stages overlap, so the longer of the two."""
        lane = self.lane_wait_s(to_decode, nbytes) if to_decode else 0.0
        return max(lane, self.expected_wait_s(ahead))

    def arrival_wait_s(self, to_decode: int) -> float:
        """The expected wait of a request arriving now, behind `to_decode` requests not yet
        decoded and all those pending: decodes ahead or slot, the longer (0 before anything
        is measured)."""
        if not self.measured:
            return 0.0
        lane = to_decode * self._loop_s_ahead()
        return max(lane, self.expected_wait_s(self.pending))

    # -- measuring --------------------------------------------------------------------------

    def observe_service(self, seconds: float) -> None:
        """Fold one request's time holding a slot into the running mean (call it before the
        slot is released)."""
        self.mean_service_s = _ewma(self.mean_service_s, seconds)
        self.completed += 1

    def observe_decode(self, started: float, ended: float, nbytes: int, waited: bool) -> None:
        """Fold one finished decode of a body of `nbytes` into the means: its time, its time
        per byte when the size is known, and, when it `waited` for the lane, the interval
        since the previous decode's end (`_turn_sample`)."""
        self.mean_decode_s = _ewma(self.mean_decode_s, ended - started)
        if nbytes > 0:
            self.mean_decode_s_per_byte = _ewma(
                self.mean_decode_s_per_byte, (ended - started) / nbytes
            )
        if waited and self._lane_free_at is not None:
            self.mean_turn_s = _ewma(self.mean_turn_s, self._turn_sample(ended))
        self._lane_free_at = ended
        self._arrived_at_lane_free = self.arrived

    def observe_encode(self, seconds: float) -> None:
        """Fold one response's encode time into the running mean."""
        self.mean_encode_s = _ewma(self.mean_encode_s, seconds)

    def _turn_sample(self, ended: float) -> float:
        """The loop time one request cost between the previous decode's end and this one's:
        the interval, shared by the requests that arrived in it (a burst's arrivals are
        read in a few long loop turns, each request once, not once per decode)."""
        assert self._lane_free_at is not None
        arrivals = self.arrived - self._arrived_at_lane_free
        return (ended - self._lane_free_at) / max(arrivals, 1)
