"""What the tests share and that holds no tests: the rank pools (multirank), independent
references (reference, dp_reference, moe_reference, smollm2), training-step and run set-ups
(parallel_step, gpt_run) and schedule-table checks (schedule_checks)."""
