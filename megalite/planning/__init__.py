"""Closed-form planning of a layout: parameters per rank (params.py), model-state bytes per
parameter under each sharding strategy (state_bytes.py), activations (activations.py), FLOPs
(flops.py), and the whole plan with its communication (planner.py)."""
