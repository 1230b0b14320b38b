"""What an in-process engine run (`batch-run --local`, `infer`) tells its crash guard: the phase it is in.

The guard (runtime/supervision/crash_guard.py, in the CLI's parent process) prints the last phase when the child
dies by a signal; the runs only call `on_phase(text, crash_point)`, so they need nothing of the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CLOSING = "closing the engine"  # the phase of the engine's teardown, once every request has ended


def describe_requests(numbers: Sequence[int], total: int) -> str:
    """'decoding request 3 of 10', 'decoding requests 3-6 of 10', 'decoding requests 1, 4, 9 of 10'."""
    nums = sorted(set(numbers))
    if len(nums) == 1:
        return f"decoding request {nums[0]} of {total}"
    if nums == list(range(nums[0], nums[-1] + 1)):
        listed = f"{nums[0]}-{nums[-1]}"
    else:
        listed = ", ".join(map(str, nums[:6])) + (f" and {len(nums) - 6} more" if len(nums) > 6 else "")
    return f"decoding requests {listed} of {total}"


def decoding_reporter(
    on_phase: Callable[[str, str | None], None],
    places: dict[str, tuple[int, str | None]],
    total: int,
    started: set[int],
) -> Callable[[tuple[str, ...]], None]:
    """The engine's on_decoding hook of a guarded command: the phase of the requests its next step decodes.

    `places`: request id -> (its 1-based place in the file, a note for the phase of a request decoded
    alone, or None): "decoding request 3 of 10 (id "r2")". `started`: the places whose crash point
    ("decoding:N") was passed already, kept across calls: each is passed once, when the request
    first enters the engine's steps.
    """

    def decoding(ids: tuple[str, ...]) -> None:
        found = [places[rid] for rid in ids if rid in places]
        if not found:
            return
        text = describe_requests([n for n, _ in found], total)
        if len(found) == 1 and found[0][1]:
            text += f" ({found[0][1]})"
        on_phase(text, None)
        for n, _ in found:
            if n not in started:
                started.add(n)
                on_phase(text, f"decoding:{n}")

    return decoding
