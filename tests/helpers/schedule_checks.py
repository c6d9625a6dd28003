"""Checks shared by the schedule-table tests."""
from megalite.schedules.instructions import Kind


def assert_dependencies_hold(spans: dict, last_stage: int, backward: Kind = Kind.BACKWARD) -> None:
    """Simulated spans keyed (kind, global stage, microbatch): F after the previous stage's F,
    the backward (fused B+W, or zero-bubble's B) after its own F and the next stage's, W after
    its B."""
    F, W = Kind.FORWARD, Kind.BACKWARD_WEIGHT
    for (kind, stage, mb), span in spans.items():
        if kind is F and stage > 0:
            assert span.start >= spans[F, stage - 1, mb].end
        if kind is backward:
            assert span.start >= spans[F, stage, mb].end
            if stage < last_stage:
                assert span.start >= spans[backward, stage + 1, mb].end
        if kind is W:
            assert span.start >= spans[backward, stage, mb].end
