"""The utility layer under `comm`: waiting with a way out (`stall`) and flat buffers (`flat`).

Imports nothing from the rest of mpitrain, so every layer may use it."""
