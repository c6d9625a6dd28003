"""Pipeline schedules: the instruction set (`instructions`), the builders and one record per
schedule kind (`tables`), their accounting, and the executor that runs a table."""
from megalite.placement import PIPELINE_SCHEDULES
from megalite.schedules.executor import get_forward_backward_func
from megalite.schedules.tables import (SCHEDULE_KINDS, ScheduleKind, resolve_schedule,
                                       schedule_kind)

__all__ = ["get_forward_backward_func", "resolve_schedule", "schedule_kind", "ScheduleKind",
           "SCHEDULE_KINDS", "PIPELINE_SCHEDULES"]
