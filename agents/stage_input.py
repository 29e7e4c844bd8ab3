"""The one error a stage executor raises for input it cannot run (its own module so that the
executor registry and the layer executor share it without importing each other)."""


class StageInputError(ValueError):
    """An input a stage cannot run: wrong shape or dtype, unknown micro-batch group. Raised
    before any state changes, so the stage loop drops the frame and the run goes on."""


class ReservationExceeded(StageInputError):
    """A step needs more KV cache than the stage reserved at load: the run itself is too
    large for this load (not a stray frame), so it fails the run instead of being dropped."""
