"""Load, reproduction and triage tools for the PD stack (see the Bench section of README.md)."""
