"""Load, reproduction and triage tools for the PD stack (see bench/README.md)."""
