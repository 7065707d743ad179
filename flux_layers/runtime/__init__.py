"""Runtime pieces under the fused operators: schedules, topology, tuning tables, workspaces, copy engine."""
