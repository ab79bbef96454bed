"""Poller options and their validation (R14). PURE: values in, values or ConfigurationError out."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal, get_args

from ..errors import ConfigurationError
from .backoff import BackoffPolicy, ExponentialBackoff
from .duration import MAX_DURATION, as_timedelta

__all__ = ["MAX_BATCH_SIZE", "PollerOptions", "TransactionMode"]

TransactionMode = Literal["per_event", "per_batch"]

_DEFAULT_BACKOFF = ExponentialBackoff()

MAX_BATCH_SIZE = 100_000
"""The largest ``batch_size``: a claim of more would hold more leases than one poller can keep."""
MAX_RETRIES = 1_000_000


@dataclass(frozen=True, slots=True)
class PollerOptions:
    """The options one poller runs with; ``Outbox`` holds the app-wide defaults.

    Attributes:
        interval: seconds between polls when there is no work (> 0).
        batch_size: most events claimed at once (>= 1).
        lease: how long a claim is held before another poller may take the event over (> 0).
        max_retries: retries after the first attempt before dead-lettering (>= 0).
        backoff: ``backoff(retry) -> seconds | timedelta``, or a constant delay (seconds or
            timedelta); default exponential 1 s, 2 s, 4 s ... capped at 300 s.
        transaction: ``"per_event"`` (default): each delivery commits on its own, the event's
            settlement with its last delivery. ``"per_batch"``: one transaction for the whole
            claimed batch, each delivery in a savepoint of it (stores with the
            ``batched_delivery`` capability); far fewer commits, but a batch's writes and
            records become visible together, and a non-transactional handler's effects are
            repeated if the batch's commit is lost.
        prefetch: claim the next batch while one is delivered, when the last claim filled
            a batch (default False). A busy poller then overlaps the database's work on its
            claim with its own on the batch in hand. It needs a store where others may claim
            while a batch or delivery is open (``concurrent_claimers`` and
            ``concurrent_batches``: PostgreSQL, the memory store); elsewhere the poller claims
            as usual. The prefetched claims' leases run from their claim, and a poller that
            stops releases them.
    """

    interval: timedelta = timedelta(seconds=0.5)
    batch_size: int = 100
    lease: timedelta = timedelta(seconds=30)
    max_retries: int = 10
    backoff: BackoffPolicy = _DEFAULT_BACKOFF
    transaction: TransactionMode = "per_event"
    prefetch: bool = False

    @classmethod
    def build(cls, base: PollerOptions | None = None, **options: Any) -> PollerOptions:
        """Validate ``options`` and lay them over ``base`` (or the defaults).

        Raises:
            ConfigurationError: an unknown option, or a value out of range, naming the option.
        """
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            known = ", ".join(sorted(cls.__dataclass_fields__))
            raise ConfigurationError(f"unknown poller option(s) {unknown}; known: {known}")
        checked: dict[str, Any] = {}
        for name, value in options.items():
            if value is None and name in ("max_retries", "backoff"):
                continue  # None = keep the outbox-wide default
            checked[name] = _CHECKS[name](value)
        return replace(base or cls(), **checked)


def _duration(name: str) -> Any:
    def check(value: object) -> timedelta:
        return as_timedelta(value, what=name, allow_zero=False, maximum=MAX_DURATION)

    return check


def _count(name: str, minimum: int, maximum: int) -> Any:
    def check(value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
            raise ConfigurationError(
                f"{name} must be an integer from {minimum} to {maximum:,}, got {value!r:.40}"
            )
        return value

    return check


def _backoff(value: object) -> BackoffPolicy:
    if isinstance(value, timedelta | int | float) and not isinstance(value, bool):
        return _Constant(as_timedelta(value, what="backoff", maximum=MAX_DURATION))
    if not callable(value):
        raise ConfigurationError(
            f"backoff must be a callable retry -> seconds, or a constant delay, got {value!r}"
        )
    return value


def _transaction(value: object) -> TransactionMode:
    modes: tuple[TransactionMode, ...] = get_args(TransactionMode)
    for mode in modes:
        if value == mode:
            return mode
    raise ConfigurationError(f"transaction must be one of {list(modes)}, got {value!r}")


def _flag(name: str) -> Any:
    def check(value: object) -> bool:
        if not isinstance(value, bool):
            raise ConfigurationError(f"{name} must be True or False, got {value!r:.40}")
        return value

    return check


@dataclass(frozen=True, slots=True)
class _Constant:
    delay: timedelta

    def __call__(self, retry: int) -> timedelta:
        return self.delay


_CHECKS = {
    "interval": _duration("interval"),
    "batch_size": _count("batch_size", 1, MAX_BATCH_SIZE),
    "lease": _duration("lease"),
    "max_retries": _count("max_retries", 0, MAX_RETRIES),
    "backoff": _backoff,
    "transaction": _transaction,
    "prefetch": _flag("prefetch"),
}
