"""The `flashlm` command line: `main` (the commands) and `sim` (the simulator's commands)."""
