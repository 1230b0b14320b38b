"""What the node knows about the machine it runs on: Jetson telemetry, energy per token, GPU and process
memory, memory pressure, and the per-board model presets."""
